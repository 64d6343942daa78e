"""Finding-level labels from report text, and the finding-F1 rewards built on them.

A small rule-based labeler in the manner of the CheXpert labeler (mention phrases,
then negation and uncertainty cues around each mention, then aggregation over the
report), restricted to the eight findings of the synthetic chest X-ray studies
(``grouprl.domains.radiology.synthetic.cxr``). It needs no weights, so it is the demo's reward
and the offline default; scores it produces say so (``BACKEND``).

Labels, per finding: ``1`` present, ``0`` absent, ``-1`` uncertain, ``None`` not
mentioned. Aggregation over a report: a positive mention wins over an uncertain
one, which wins over a negative one (CheXpert's order).

Laterality: ``left_effusion`` / ``right_effusion`` are the *patient's* sides, as
radiology reports write them. An effusion mention takes its side from the words
"left", "right", "bilateral", "both" in or just before the mention phrase; an
effusion mention with no side ("No pleural effusion.") applies to both sides.

Scoring convention: uncertain counts as positive in the F1 scores (the usual
"uncertain-as-positive" CheXbert-F1 convention), because a hedged mention of a
real finding is a detection, and "not mentioned" counts as not positive.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from grouprl.rewards.contract import completion_text
from grouprl.rewards.registry import register_reward

BACKEND = "grouprl.domains.radiology.findings rule-based labeler"

FINDING_NAMES: tuple[str, ...] = (
    "cardiomegaly",
    "left_effusion",
    "right_effusion",
    "pneumothorax",
    "nodule",
    "consolidation",
    "edema",
    "support_device",
)

# "effusion" stands for both sided effusion findings until the side is resolved.
_EFFUSION = "effusion"

# Mention phrases per finding, as regular expressions over lower-cased text.
# Longer phrases are preferred where two overlap (see _find_spans).
MENTIONS: dict[str, tuple[str, ...]] = {
    "cardiomegaly": (
        r"cardiomegaly",
        r"cardiac enlargement",
        r"enlarged (?:heart|cardiac silhouette)",
        r"enlargement of the (?:heart|cardiac silhouette)",
    ),
    _EFFUSION: (
        r"(?:pleural )?effusions?(?: on the (?:left|right)| bilaterally)?",
        r"pleural fluid",
        r"blunting of (?:the |both )?(?:left |right )?costophrenic angles?",
        r"blunted (?:left |right )?costophrenic angles?",
        r"costophrenic angle blunting",
    ),
    "pneumothorax": (r"pneumothorax", r"pneumothoraces"),
    "nodule": (r"nodules?", r"nodular opacity", r"nodular opacities", r"mass(?:es)?"),
    "consolidation": (
        r"consolidations?",
        r"consolidative opacity",
        r"airspace (?:opacity|opacities|disease)",
        r"pneumonia",
    ),
    "edema": (r"edema", r"(?:vascular|venous) congestion"),
    "support_device": (
        r"support devices?",
        r"(?:endotracheal|enteric|nasogastric|feeding|chest|tracheostomy) tubes?",
        r"tubes?",
        # "pleural line" is the edge of a collapsed lung (pneumothorax), not a device.
        r"(?<!pleural )lines?",
        r"catheters?",
        r"picc",
        r"pacemakers?",
        r"pacer",
        r"defibrillator",
    ),
}

# Mentions that carry their own verb ("the heart is enlarged"). Cues outside them are
# not applied: in "No effusion, and the heart is enlarged" the "no" belongs to the
# effusion. Cue words inside them ("the heart may be enlarged") still count.
PREDICATIVE: dict[str, tuple[str, ...]] = {
    "cardiomegaly": (
        r"(?:heart|cardiac silhouette)(?: size)? (?:is|appears|remains|seems)(?: \w+){0,2} enlarged",
        r"(?:heart|cardiac silhouette)(?: size)? (?:may|might|could) be(?: \w+)? enlarged",
    ),
    _EFFUSION: (r"costophrenic angles? (?:is|are|appears?)(?: \w+)? blunted",),
}

# Phrases that state a finding is absent without a negation word ("heart size is
# normal"): labelled 0 directly, and matched before the mentions so that "the heart
# is not enlarged" is not read as an enlarged heart.
NORMAL: dict[str, tuple[str, ...]] = {
    "cardiomegaly": (
        r"heart size (?:is )?(?:normal|within normal limits)",
        r"normal (?:heart size|cardiac silhouette|size of the heart)",
        r"(?:heart|cardiac silhouette|cardiomediastinal silhouette)(?: size)? (?:is|appears) "
        r"(?:normal(?: in size)?|within normal limits|not enlarged)",
    ),
    _EFFUSION: (
        r"(?:costophrenic angles? (?:is|are) (?:sharp|clear))",
        r"sharp (?:left |right )?costophrenic angles?",
    ),
    "edema": (r"pulmonary vasculature is normal", r"normal pulmonary vascularity"),
}

# Cues, as (pattern, direction). A "pre" cue governs the mentions after it in its
# clause, a "post" cue the mention (or list of mentions) just before it, "both" either.
# Uncertainty cues are matched before negation cues, so that the "not" of "cannot
# exclude" never negates.
UNCERTAIN_CUES: tuple[tuple[str, str], ...] = (
    (r"(?:cannot|can not) (?:exclude|rule out)", "pre"),
    (r"(?:cannot|can not) be (?:excluded|ruled out)", "post"),
    (r"not (?:entirely )?(?:excluded|ruled out)", "post"),
    (r"(?:may|might|could) (?:represent|reflect|be)", "pre"),
    (r"(?:may|might|could) be present", "post"),
    (r"question of", "pre"),
    (r"(?:suspicious|concerning) for", "pre"),
    (r"suggestive of", "pre"),
    (r"possibly|probably|equivocal|borderline", "pre"),
    (r"possible|probable|likely|questionable|suspected|questioned", "both"),
)
NEGATIVE_CUES: tuple[tuple[str, str], ...] = (
    (r"no (?:evidence|signs?) of", "pre"),
    (r"negative for|free of|absence of|resolution of", "pre"),
    (r"(?:not|no longer) (?:seen|identified|present|visualized|visible|evident|appreciated|demonstrated)", "post"),
    (r"absent|resolved|ruled out|excluded", "post"),
    (r"without|no|not|neither|nor", "pre"),
)

# A word in the gap between a pre cue and a mention that ends the cue's reach:
# conjunctions that start a new statement, and verbs ("no effusion is seen, there is ...").
_PRE_BREAKERS = frozenset(
    "but however although though which while whereas except apart aside besides "
    "there is are was were has have had shows show demonstrates reveals seen noted "
    "present identified".split()
)
# Words allowed between chained mentions ("consolidation or effusion is not seen")
# and between the last mention and a post cue.
_CHAIN_WORDS = frozenset(
    "and or nor either neither any a an the left right bilateral small large moderate mild "
    "tiny focal pleural pulmonary apical definite".split()
)
_POST_GAP_WORDS = frozenset("is are was were has have been be currently now also definitely clearly".split())
_SIDE_WORDS = {"left": ("left",), "right": ("right",), "bilateral": ("left", "right"),
               "bilaterally": ("left", "right"), "both": ("left", "right")}
# How many words before an effusion phrase may carry its side ("moderate left and small right").
_SIDE_LOOKBACK = 5

_SENTENCE_SPLIT = re.compile(r"(?<!\d)\.(?!\d)|[\n!?]")
# Clause boundaries beyond which no cue reaches.
_CLAUSE_SPLIT = re.compile(r"[;:]|\b(?:but|however|although|though|whereas|except)\b")
_WORD = re.compile(r"[a-z]+")
_MASK = "#"


def _compile(patterns: Sequence[str]) -> list[re.Pattern[str]]:
    # Word boundaries on both ends: "no" must not match inside "nodule" or "normal".
    return [re.compile(rf"\b(?:{p})\b") for p in patterns]


_MENTION_RES = {f: _compile(ps) for f, ps in MENTIONS.items()}
_PREDICATIVE_RES = {f: _compile(ps) for f, ps in PREDICATIVE.items()}
_NORMAL_RES = {f: _compile(ps) for f, ps in NORMAL.items()}
_UNCERTAIN_RES = {("unc", d): _compile([p for p, dd in UNCERTAIN_CUES if dd == d]) for d in ("pre", "post", "both")}
_NEGATIVE_RES = {("neg", d): _compile([p for p, dd in NEGATIVE_CUES if dd == d]) for d in ("pre", "post", "both")}
# Cue words inside a mention phrase ("the heart may be enlarged").
_INNER_UNCERTAIN = frozenset("may might could possibly probably likely questionably borderline".split())
_INNER_NEGATIVE = frozenset("no not".split())


@dataclass
class _Span:
    start: int
    end: int
    finding: str
    kind: str  # "mention", "predicative" or "normal"


@dataclass
class _Cue:
    start: int
    end: int
    polarity: str  # "unc" or "neg"
    direction: str  # "pre", "post" or "both"


def _find_spans(text: str, patterns: dict[Any, list[re.Pattern[str]]]) -> list[tuple[int, int, Any]]:
    """Non-overlapping matches of all patterns, leftmost first and longest at a tie."""
    found = [(m.start(), m.end(), key) for key, res in patterns.items() for r in res for m in r.finditer(text)]
    found.sort(key=lambda s: (s[0], -(s[1] - s[0])))
    chosen: list[tuple[int, int, Any]] = []
    end = -1
    for start, stop, key in found:
        if start >= end:
            chosen.append((start, stop, key))
            end = stop
    return chosen


def _masked(text: str, spans: Sequence[tuple[int, int, Any]]) -> str:
    chars = list(text)
    for start, end, _ in spans:
        chars[start:end] = _MASK * (end - start)
    return "".join(chars)


def _words(text: str) -> list[str]:
    return _WORD.findall(text)


def _gap_words(clause: str, start: int, end: int, skip: Sequence[_Span]) -> list[str]:
    """Words of clause[start:end] outside the spans in ``skip``."""
    chars = list(clause[start:end])
    for s in skip:
        lo, hi = max(s.start, start), min(s.end, end)
        if lo < hi:
            chars[lo - start : hi - start] = " " * (hi - lo)
    return _words("".join(chars))


def _label_clause(clause: str) -> list[tuple[_Span, int]]:
    """(span, label) for every finding phrase in one clause."""
    # Order matters: each kind of phrase is masked out before the next is searched, so
    # that "the heart is not enlarged" (normal) never yields the mention "enlarged" and
    # the "not" of "cannot be excluded" (uncertain) never yields a negation.
    normal = _find_spans(clause, _NORMAL_RES)
    rest = _masked(clause, normal)
    predicative = _find_spans(rest, _PREDICATIVE_RES)
    rest = _masked(rest, predicative)
    mentions = _find_spans(rest, _MENTION_RES)
    rest = _masked(rest, mentions)
    cues: list[_Cue] = []
    for patterns in (_UNCERTAIN_RES, _NEGATIVE_RES):
        found = _find_spans(rest, patterns)
        cues += [_Cue(s, e, *key) for s, e, key in found]
        rest = _masked(rest, found)
    cues.sort(key=lambda c: c.start)

    spans = sorted(
        [_Span(s, e, f, "normal") for s, e, f in normal]
        + [_Span(s, e, f, "predicative") for s, e, f in predicative]
        + [_Span(s, e, f, "mention") for s, e, f in mentions],
        key=lambda s: s.start,
    )
    return [(span, _label_span(clause, spans, i, cues)) for i, span in enumerate(spans)]


def _label_span(clause: str, spans: list[_Span], i: int, cues: list[_Cue]) -> int:
    span = spans[i]
    if span.kind == "normal":
        return 0
    inner = set(_words(clause[span.start : span.end]))
    if inner & _INNER_UNCERTAIN:
        return -1
    if span.kind == "predicative":
        # A phrase with its own verb is a statement of its own: cues outside it belong
        # to the other phrases of the clause ("no effusion, and the heart is enlarged").
        return 0 if inner & _INNER_NEGATIVE else 1
    governing = [c for c in (_pre_cue(clause, spans, i, cues), _post_cue(clause, spans, i, cues)) if c is not None]
    if any(c.polarity == "unc" for c in governing):
        return -1
    return 0 if governing else 1


def _pre_cue(clause: str, spans: list[_Span], i: int, cues: list[_Cue]) -> _Cue | None:
    """The pre cue reaching mention i: the nearest one before it, unless a verb or
    conjunction intervenes ("possible consolidation without effusion": the effusion
    is governed by "without", not by "possible")."""
    span = spans[i]
    before = [c for c in cues if c.direction in ("pre", "both") and c.end <= span.start]
    if not before:
        return None
    cue = before[-1]
    gap = _gap_words(clause, cue.end, span.start, spans)
    return None if set(gap) & _PRE_BREAKERS else cue


def _post_cue(clause: str, spans: list[_Span], i: int, cues: list[_Cue]) -> _Cue | None:
    """The post cue reaching mention i: the first one after it, reached over a list of
    mentions joined by list words ("consolidation or effusion is not seen") and then
    auxiliary verbs only."""
    span = spans[i]
    after = [c for c in cues if c.direction in ("post", "both") and c.start >= span.end]
    if not after:
        return None
    cue = after[0]
    pos = span.end
    for other in spans[i + 1 :]:
        if other.start >= cue.start:
            break
        if other.kind != "mention" or not set(_words(clause[pos : other.start])) <= _CHAIN_WORDS:
            return None
        pos = other.end
    between = clause[pos : cue.start]
    # A comma ends the subject: in "left effusion, likely right effusion" the "likely"
    # is about what follows it.
    return cue if "," not in between and set(_words(between)) <= _POST_GAP_WORDS else None


def _sides(clause: str, spans: list[_Span], span: _Span) -> tuple[str, ...]:
    """The effusion sides a phrase is about: side words in it or just before it."""
    prev_end = max((s.end for s in spans if s.end <= span.start), default=0)
    before = _words(clause[prev_end : span.start])[-_SIDE_LOOKBACK:]
    sides: set[str] = set()
    for word in before + _words(clause[span.start : span.end]):
        sides.update(_SIDE_WORDS.get(word, ()))
    return tuple(sorted(sides)) if sides else ("left", "right")


def _clauses(text: str) -> list[str]:
    clauses = []
    for sentence in _SENTENCE_SPLIT.split(text.lower()):
        clauses += [c for c in _CLAUSE_SPLIT.split(sentence) if c.strip()]
    return clauses


def extract_findings(text: str) -> dict[str, int | None]:
    """Label each finding of ``FINDING_NAMES`` from a report: 1, 0, -1 or None.

    Rules per clause: mention phrases (``MENTIONS``, ``PREDICATIVE``) and phrases of
    normality (``NORMAL``, label 0); a mention is uncertain (-1) when an uncertainty cue
    reaches it, else negative (0) when a negation cue does, else positive (1). Over the
    report, positive > uncertain > negative > not mentioned (None).
    """
    labels: dict[str, int | None] = {name: None for name in FINDING_NAMES}
    for clause in _clauses(text or ""):
        labelled = _label_clause(clause)
        spans = [span for span, _ in labelled]
        for span, label in labelled:
            if span.finding == _EFFUSION:
                names = [f"{side}_effusion" for side in _sides(clause, spans, span)]
            else:
                names = [span.finding]
            for name in names:
                labels[name] = _stronger(labels[name], label)
    return labels


# Aggregation order over a report: positive, then uncertain, then negative.
_RANK = {None: 0, 0: 1, -1: 2, 1: 3}


def _stronger(a: int | None, b: int | None) -> int | None:
    return a if _RANK[a] >= _RANK[b] else b


# ---------------------------------------------------------------- scores


def positive_findings(labels: dict[str, int | None]) -> set[str]:
    """The findings counted as present: positive or uncertain (uncertain-as-positive)."""
    return {name for name in FINDING_NAMES if labels.get(name) in (1, -1)}


def finding_f1(pred: dict[str, int | None], ref: dict[str, int | None]) -> float:
    """F1 of the predicted positive findings against the reference's.

    ``F1 = 2 TP / (2 TP + FP + FN)`` over ``FINDING_NAMES``, uncertain counted as
    positive. When neither has a positive finding the prediction is exactly right
    (a normal study described as normal) and scores 1.0.
    """
    p, r = positive_findings(pred), positive_findings(ref)
    if not p and not r:
        return 1.0
    tp = len(p & r)
    return 2 * tp / (len(p) + len(r))


def finding_accuracy(pred: dict[str, int | None], ref: dict[str, int | None]) -> float:
    """The fraction of ``FINDING_NAMES`` whose status (positive or not) agrees.

    Denser than F1: a report that gets the absent findings right is rewarded too,
    which gives a tiny model a signal before it finds any positive.
    """
    p, r = positive_findings(pred), positive_findings(ref)
    return sum((name in p) == (name in r) for name in FINDING_NAMES) / len(FINDING_NAMES)


def _score_rows(score, completions: Sequence[Any], answer: Sequence[Any] | None) -> list[float | None]:
    if answer is None:
        return [None] * len(completions)
    return [
        None if ref is None else score(extract_findings(completion_text(c)), extract_findings(completion_text(ref)))
        for c, ref in zip(completions, answer)
    ]


@register_reward("finding_f1")
def finding_f1_reward(
    prompts: Sequence[str], completions: Sequence[Any], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Per row, :func:`finding_f1` between the findings read from the completion and
    from the reference report in the ``answer`` column (None where there is none)."""
    return _score_rows(finding_f1, completions, answer)


@register_reward("finding_accuracy")
def finding_accuracy_reward(
    prompts: Sequence[str], completions: Sequence[Any], *, answer: Sequence[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Per row, :func:`finding_accuracy` between the completion's findings and the
    reference report's (None where there is no reference)."""
    return _score_rows(finding_accuracy, completions, answer)


def corpus_finding_scores(preds: Sequence[str], refs: Sequence[str]) -> dict[str, Any]:
    """Finding-level scores of generated reports against references over a test set.

    ``micro_f1``: F1 over all (report, finding) pairs, positive class. ``macro_f1``:
    the mean of the per-finding F1s over the findings positive in at least one
    reference or prediction (F1 is undefined for the others; ``per_finding_f1`` lists
    those that count). ``sample_f1``: the mean of :func:`finding_f1` per report.
    ``accuracy``: the mean of :func:`finding_accuracy`. ``backend`` names the labeler.
    """
    if len(preds) != len(refs):
        raise ValueError(f"got {len(preds)} predictions for {len(refs)} references")
    tp = {name: 0 for name in FINDING_NAMES}
    fp = dict(tp)
    fn = dict(tp)
    sample_f1, accuracy = [], []
    for pred_text, ref_text in zip(preds, refs):
        pred, ref = extract_findings(pred_text), extract_findings(ref_text)
        p, r = positive_findings(pred), positive_findings(ref)
        for name in FINDING_NAMES:
            tp[name] += name in p and name in r
            fp[name] += name in p and name not in r
            fn[name] += name not in p and name in r
        sample_f1.append(finding_f1(pred, ref))
        accuracy.append(finding_accuracy(pred, ref))
    per_finding = {
        name: 2 * tp[name] / (2 * tp[name] + fp[name] + fn[name])
        for name in FINDING_NAMES
        if tp[name] + fp[name] + fn[name]
    }
    total_tp, total_fp, total_fn = sum(tp.values()), sum(fp.values()), sum(fn.values())
    denominator = 2 * total_tp + total_fp + total_fn
    n = len(preds)
    return {
        "micro_f1": 2 * total_tp / denominator if denominator else 1.0,
        "macro_f1": sum(per_finding.values()) / len(per_finding) if per_finding else 1.0,
        "sample_f1": sum(sample_f1) / n if n else 0.0,
        "accuracy": sum(accuracy) / n if n else 0.0,
        "per_finding_f1": per_finding,
        "n": n,
        "backend": BACKEND,
    }
