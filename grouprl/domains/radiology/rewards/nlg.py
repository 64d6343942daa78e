"""Lexical report metrics: BLEU-1..4, ROUGE-L, CIDEr-D and METEOR, through maintained libraries.

Two uses, two functions:

- :func:`nlg_corpus_scores` — the corpus numbers papers report (R2Gen, EditGRPO's
  evaluation), computed with ``pycocoevalcap`` (the COCO caption evaluation code):
  corpus BLEU-1..4 (closest reference length, no smoothing), ROUGE-L (LCS F-measure,
  beta 1.2, mean over samples), CIDEr-D (document frequencies over the corpus
  references, sigma 6, clipping, x10) and METEOR 1.5 (Java, see below).
- Per-sample components for rewards and per-sample tables, registered as
  ``bleu1``..``bleu4``, ``rougeL`` and ``cider``:

  * ``bleuN`` — sentence-level BLEU with maximum order N from ``sacrebleu``, smoothed
    with sacrebleu's ``exp`` method (Chen & Cherry 2014 method 3, the NIST/mteval
    smoothing: the k-th order without a match gets precision 1 / (2^k * total)) and
    ``effective_order`` (orders longer than the hypothesis are left out), so short
    reports are not all zero. Scale 0..1.
  * ``rougeL`` — pycocoevalcap's per-sample ROUGE-L; their mean is the corpus ROUGE-L.
  * ``cider`` — pycocoevalcap CIDEr-D with the document frequencies taken over the
    references of the scored batch (a corpus statistic has no per-sample form). GRPO
    groups repeat a reference n times; with equal group sizes that leaves the IDF
    unchanged. A batch whose references are all the same has no usable IDF (every
    n-gram of the reference gets weight log(1) - log(1) = 0), so the component raises
    instead of returning zeros.

Tokenization (all metrics): the reports are lower-cased and split into words with a
pure-Python rule close to the PTB tokenizer plus punctuation removal that the COCO
evaluation applies (pycocoevalcap's own tokenizer runs Stanford CoreNLP in Java):
words are runs of letters and digits, keeping inner ``.`` ``'`` ``/`` ``-`` (``3.5``,
``x-ray``, ``ap/pa``); all other punctuation is dropped.

METEOR has no maintained pure-Python offline implementation: NLTK's needs the WordNet
corpus, which NLTK downloads at run time and no maintained PyPI package ships. It
is computed by pycocoevalcap's bundled ``meteor-1.5.jar`` (its paraphrase table is in
the package), which needs a Java runtime (``java`` on PATH, e.g. Debian's
``default-jre-headless``). Without Java, ``nlg_corpus_scores`` reports ``meteor`` as
None (``meteor="auto"``) or raises :class:`MeteorUnavailable` (``meteor=True``).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from typing import Sequence

from grouprl.domains.radiology.rewards.components import register_component

_EXTRA_HINT = "pip install 'grouprl[metrics]'"

TOKENIZER = "lowercased PTB-like words (punctuation dropped)"
BLEU_BACKEND = f"bleu=sacrebleu sentence BLEU, smooth=exp, effective_order, tokens={TOKENIZER}"
ROUGE_BACKEND = f"rougeL=pycocoevalcap (LCS F, beta=1.2), tokens={TOKENIZER}"
CIDER_BACKEND = f"cider=pycocoevalcap CIDEr-D (idf over the batch references), tokens={TOKENIZER}"

_WORD = re.compile(r"[^\W_]+(?:[.'\u2019/\-][^\W_]+)*")


class MeteorUnavailable(RuntimeError):
    """METEOR was asked for but cannot run here (no Java runtime, or the METEOR process failed)."""


def tokenize_report(text: str) -> str:
    """Lower-cased words of ``text`` joined by single spaces (the form every metric here scores)."""
    if not isinstance(text, str):
        raise TypeError(f"a report must be a string, got {type(text).__name__}")
    return " ".join(_WORD.findall(text.lower()))


def _check_pairs(hyps: Sequence[str], refs: Sequence[str]) -> tuple[list[str], list[str]]:
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    return [tokenize_report(h) for h in hyps], [tokenize_report(r) for r in refs]


def _import_error(package: str, exc: ImportError) -> ImportError:
    return ImportError(f"{package} is needed for the NLG metrics but cannot be imported ({exc}); {_EXTRA_HINT}")


# ---------------------------------------------------------------- per-sample components


@functools.lru_cache(maxsize=None)
def _sentence_bleu(order: int):
    try:
        from sacrebleu.metrics import BLEU
    except ImportError as exc:
        raise _import_error("sacrebleu", exc) from exc
    # tokenize="none": the text is already tokenized and lower-cased by tokenize_report.
    return BLEU(max_ngram_order=order, smooth_method="exp", effective_order=True, tokenize="none")


def sentence_bleu(hyps: Sequence[str], refs: Sequence[str], order: int = 4) -> list[float]:
    """Smoothed sentence-level BLEU-``order`` (0..1) of each pair (sacrebleu, see the module doc).

    An empty hypothesis (or one with no word in common with the reference) scores 0.
    """
    if order not in (1, 2, 3, 4):
        raise ValueError(f"BLEU order must be 1..4, got {order}")
    hyp_toks, ref_toks = _check_pairs(hyps, refs)
    bleu = _sentence_bleu(order)
    out = []
    for h, r in zip(hyp_toks, ref_toks):
        # min: identical texts come out as 1.0000000000000004 after the geometric mean.
        out.append(0.0 if not h or not r else min(1.0, bleu.sentence_score(h, [r]).score / 100.0))
    return out


def rouge_l(hyps: Sequence[str], refs: Sequence[str]) -> list[float]:
    """ROUGE-L F-measure (beta 1.2, pycocoevalcap) of each pair; an empty side scores 0."""
    hyp_toks, ref_toks = _check_pairs(hyps, refs)
    try:
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError as exc:
        raise _import_error("pycocoevalcap", exc) from exc
    scorer = Rouge()
    # pycocoevalcap splits on " "; an empty string would become the one token "" and two
    # empty reports would "match", so an empty side is scored 0 here.
    return [scorer.calc_score([h], [r]) if h and r else 0.0 for h, r in zip(hyp_toks, ref_toks)]


def cider_d(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, list[float]]:
    """CIDEr-D (pycocoevalcap) of the pairs with document frequencies over ``refs``: (mean, per pair).

    Raises ValueError when ``refs`` holds fewer than two distinct (tokenized) reports,
    where the IDF is identically zero and every score would be 0 whatever the hypothesis.
    """
    hyp_toks, ref_toks = _check_pairs(hyps, refs)
    if len(set(ref_toks)) < 2:
        raise ValueError(
            "CIDEr needs at least 2 distinct references in the scored batch for its document "
            f"frequencies (got {len(set(ref_toks))}); score more than one prompt per batch, or use "
            "the corpus metrics (nlg_corpus_scores) over a test set"
        )
    try:
        from pycocoevalcap.cider.cider_scorer import CiderScorer
    except ImportError as exc:
        raise _import_error("pycocoevalcap", exc) from exc
    scorer = CiderScorer(n=4, sigma=6.0)
    for h, r in zip(hyp_toks, ref_toks):
        scorer += (h, [r])
    mean, scores = scorer.compute_score()
    return float(mean), [float(s) for s in scores]


def _bleu_component(order: int):
    def component(hyps: list[str], refs: list[str]) -> list[float]:
        return sentence_bleu(hyps, refs, order)

    component.__name__ = component.__qualname__ = f"bleu{order}_component"
    component.__doc__ = f"Smoothed sentence-level BLEU-{order} (sacrebleu exp smoothing), 0..1."
    return component


bleu1_component = register_component("bleu1", backend=BLEU_BACKEND)(_bleu_component(1))
bleu2_component = register_component("bleu2", backend=BLEU_BACKEND)(_bleu_component(2))
bleu3_component = register_component("bleu3", backend=BLEU_BACKEND)(_bleu_component(3))
bleu4_component = register_component("bleu4", backend=BLEU_BACKEND)(_bleu_component(4))


@register_component("rougeL", backend=ROUGE_BACKEND)
def rouge_l_component(hyps: list[str], refs: list[str]) -> list[float]:
    """ROUGE-L F-measure (beta 1.2), 0..1."""
    return rouge_l(hyps, refs)


@register_component("cider", backend=CIDER_BACKEND)
def cider_component(hyps: list[str], refs: list[str]) -> list[float]:
    """CIDEr-D with the IDF over the batch's references (needs >= 2 distinct references), 0..10."""
    return cider_d(hyps, refs)[1]


# ---------------------------------------------------------------- METEOR


def java_available() -> bool:
    """True when a ``java`` executable is on PATH (pycocoevalcap's METEOR needs one)."""
    return shutil.which("java") is not None


def meteor(hyps: Sequence[str], refs: Sequence[str]) -> tuple[float, list[float]]:
    """METEOR 1.5 (pycocoevalcap's jar, English, normalised): (corpus score, per pair).

    Raises :class:`MeteorUnavailable` without a Java runtime or when the METEOR process fails.
    """
    hyp_toks, ref_toks = _check_pairs(hyps, refs)
    if not hyp_toks:
        raise ValueError("METEOR of an empty corpus is undefined")
    if not java_available():
        raise MeteorUnavailable(
            "METEOR needs a Java runtime (pycocoevalcap runs meteor-1.5.jar): install one, e.g. "
            "'apt-get install default-jre-headless', so that 'java' is on PATH"
        )
    try:
        from pycocoevalcap.meteor.meteor import Meteor
    except ImportError as exc:
        raise _import_error("pycocoevalcap", exc) from exc
    # METEOR's stdin protocol cannot take an empty segment; a lone "." scores 0 like nothing.
    gts = {i: [r or "."] for i, r in enumerate(ref_toks)}
    res = {i: [h or "."] for i, h in enumerate(hyp_toks)}
    try:
        scorer = Meteor()
    except OSError as exc:
        raise MeteorUnavailable(f"cannot start METEOR (java -jar meteor-1.5.jar): {exc}") from exc
    try:
        score, scores = scorer.compute_score(gts, res)
    except Exception as exc:
        stderr = b""
        try:
            scorer.meteor_p.kill()
            stderr = scorer.meteor_p.stderr.read() or b""
        except Exception:
            pass
        raise MeteorUnavailable(
            f"the METEOR process failed ({type(exc).__name__}: {exc}); java said: "
            f"{stderr.decode(errors='replace')[-500:]!r}"
        ) from exc
    finally:
        # Its __del__ waits on this lock; a failed call leaves it held.
        if scorer.lock.locked():
            scorer.lock.release()
        _close_meteor(scorer)
    return float(score), [float(s) for s in scores]


def _close_meteor(scorer) -> None:
    try:
        scorer.meteor_p.stdin.close()
        scorer.meteor_p.kill()
        scorer.meteor_p.wait(timeout=10)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass


# ---------------------------------------------------------------- corpus


def nlg_corpus_scores(hyps: Sequence[str], refs: Sequence[str], *, meteor_mode: str | bool = "auto") -> dict:
    """Corpus BLEU-1..4, ROUGE-L, CIDEr-D and METEOR with pycocoevalcap.

    Returns ``{"bleu1".."bleu4", "rougeL", "cider", "meteor": float | None, "backend": str,
    "backends": {metric: str}}`` (one backend string for all, and one per metric).
    BLEU is corpus BLEU (summed n-gram statistics, closest reference length, no
    smoothing), ROUGE-L the mean per-sample F-measure, CIDEr-D with document
    frequencies over ``refs`` (None when they hold fewer than 2 distinct reports:
    undefined). ``meteor_mode``: ``"auto"`` computes METEOR when Java is available and
    gives None otherwise; True requires it (:class:`MeteorUnavailable`); False skips it.
    The ``backend`` string says which library and tokenization produced each number.
    """
    if meteor_mode not in ("auto", True, False):
        raise ValueError(f"meteor_mode must be 'auto', True or False, got {meteor_mode!r}")
    hyp_toks, ref_toks = _check_pairs(hyps, refs)
    if not hyp_toks:
        raise ValueError("corpus metrics of an empty corpus are undefined")
    try:
        from pycocoevalcap.bleu.bleu import Bleu
    except ImportError as exc:
        raise _import_error("pycocoevalcap", exc) from exc
    gts = {i: [r] for i, r in enumerate(ref_toks)}
    res = {i: [h] for i, h in enumerate(hyp_toks)}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    out: dict = {f"bleu{n + 1}": float(b) for n, b in enumerate(bleu)}
    rouge = rouge_l(hyps, refs)
    out["rougeL"] = sum(rouge) / len(rouge)
    tokens = f", tokens={TOKENIZER}"
    per_metric = {f"bleu{n}": f"bleu=pycocoevalcap corpus BLEU{tokens}" for n in range(1, 5)}
    per_metric["rougeL"] = f"rougeL=pycocoevalcap (beta=1.2){tokens}"
    if len(set(ref_toks)) >= 2:
        out["cider"] = cider_d(hyps, refs)[0]
        per_metric["cider"] = f"cider=pycocoevalcap CIDEr-D (idf over the corpus references){tokens}"
    else:
        out["cider"] = None
        per_metric["cider"] = "cider=undefined (fewer than 2 distinct references)"
    out["meteor"] = None
    if meteor_mode is True or (meteor_mode == "auto" and java_available()):
        out["meteor"] = meteor(hyps, refs)[0]
        per_metric["meteor"] = "meteor=pycocoevalcap meteor-1.5.jar (java)"
    elif meteor_mode == "auto":
        per_metric["meteor"] = "meteor=unavailable (no java on PATH)"
    else:
        per_metric["meteor"] = "meteor=skipped"
    out["backend"] = ", ".join(
        [per_metric["bleu1"].removesuffix(tokens), per_metric["rougeL"].removesuffix(tokens),
         per_metric["cider"].removesuffix(tokens), per_metric["meteor"], tokens.lstrip(", ")]
    )
    out["backends"] = per_metric
    return out
