"""EditGRPO's post-rollout edits: sentence-level corrections of sampled reports.

After sampling, some responses are corrected against the prompt's reference report
and trained on like the policy's own samples (their old log-probs are computed by
the actor after this transform, so the ratio starts at 1). Two layers:

- :func:`edit_report` edits one report. It matches the entities of the response
  with those of the reference (an *extractor*, see :func:`build_extractor`) and applies
  up to ``num_ops`` sentence operations, in this priority:

  1. ``correct``: a sentence with a finding the reference states with the opposite
     polarity ("small effusion" against "no effusion") is replaced by the reference
     sentence holding that finding, so the polarity now agrees with the reference;
  2. ``replace`` / ``delete``: a sentence with a false-positive entity is replaced by
     the most similar reference sentence when their similarity is at least ``tau``,
     and deleted otherwise;
  3. ``add``: a reference sentence holding a false-negative entity is appended;
  0. ``fill``: an empty response receives one reference sentence (before anything).

  The matching is recomputed after every operation, so operations never act on a
  sentence an earlier one already removed, and ``before`` / ``sentence_index`` of an
  operation refer to the report as it was just before that operation. Where several
  candidates are eligible (which FP sentence, which missing sentence, ties in
  similarity) one is chosen with ``random.Random(seed)``.

- :class:`EditTransform` applies those edits to a :class:`RolloutBatch` (the
  ``extractor_*`` options of EditGRPO and ``force_gt_num``), re-tokenizes the edited
  text with EOS and rebuilds the rows' masks.

What differs from EditGRPO's public code, on purpose: identical entities always match
(``match_entities`` uses same-type affinity 1.0 and similarity 1.0 for equal texts);
contradictions are corrected; every random choice is seeded; ``force_gt_num`` writes
each prompt's own reference; edited text ends with EOS.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from grouprl.models.inputs import end_of_turn_id, tokenizer_of
from grouprl.registry import Registry
from grouprl.domains.radiology.rewards.entities import ReportGraph, sentence_spans, split_sentences
from grouprl.domains.radiology.rewards.ratescore import EntityMatching, RateEntity, match_entities, rate_entities, text_similarity
from grouprl.rollout.batch import RolloutBatch
from grouprl.rollout.transforms import register_rollout_transform

OPERATION_TYPES = ("correct", "replace", "delete", "add", "fill")
FORCE_GT = "force_gt"  # the report-level replacement, recorded like an operation in the rollouts log
MATCH_THRESHOLD = 0.6  # entity similarity x affinity for a match, as in EditGRPO's extractor


@dataclass(frozen=True)
class EditOperation:
    """One sentence operation: ``before`` is "" for add/fill, ``after`` is "" for delete."""

    type: str  # one of OPERATION_TYPES
    before: str
    after: str
    sentence_index: int | None  # in split_sentences of the report just before this operation

    def to_dict(self) -> dict:
        return {"type": self.type, "before": self.before, "after": self.after, "sentence_index": self.sentence_index}


@dataclass(frozen=True)
class EditResult:
    text: str
    operations: list[EditOperation] = field(default_factory=list)


# ----------------------------------------------------------------------------- extractors
Extractor = Callable[[str, str], EntityMatching]
EXTRACTORS: Registry[Extractor] = Registry("extractor", error=ValueError)
# Extractors that run a model from a local directory (``extractor_model_path``): built by
# build_extractor, never taken from EXTRACTORS.
MODEL_EXTRACTORS = ("ratescore", "radgraph")
MODEL_PATH_KEY = "worker.rollout.extractor_model_path"


def register_extractor(name: str, *, overwrite: bool = False) -> Callable[[Extractor], Extractor]:
    """Decorator registering ``f(response, reference) -> EntityMatching`` under ``name`` (``extractor_type``)."""
    if name in MODEL_EXTRACTORS:
        raise ValueError(f"{name!r} is a model extractor (built by build_extractor); register under another name")
    return EXTRACTORS.register(name, overwrite=overwrite)


def available_extractors() -> list[str]:
    return sorted(set(EXTRACTORS.names()) | set(MODEL_EXTRACTORS))


def get_extractor(name: str) -> Extractor:
    """A registered (model-free) extractor; the model extractors need :func:`build_extractor`."""
    if name in MODEL_EXTRACTORS:
        raise ValueError(f"extractor {name!r} runs a model: build it with build_extractor({name!r}, model_path) "
                         f"(config key {MODEL_PATH_KEY})")
    extractor = EXTRACTORS.get(name, None)
    if extractor is None:
        raise ValueError(f"unknown extractor {name!r}; available extractors: {available_extractors()}")
    return extractor


def build_extractor(name: str, model_path: str | None = None) -> Extractor:
    """The extractor ``name`` (``extractor_type``), its model loaded now from ``model_path``.

    - registered names (``rules`` and user extractors): take no model path;
    - ``ratescore``: RaTE-NER entities (``backends.rate_ner.RateNER`` on the local
      token-classification directory ``model_path``) matched by ``match_entities``;
    - ``radgraph``: the RadGraph model (``backends.radgraph_model.RadGraphModel`` on
      ``model_path``; needs the ``radgraph`` package) whose graphs ``match_entities``
      folds and matches. Its graphs are of the package's tokenized text; entity
      positions are mapped back to the original report (see :func:`_graph_entities`).

    Models are loaded once per process per path (the backends' ``load_*`` caches),
    and run on CPU.
    """
    if name in MODEL_EXTRACTORS:
        if model_path is None or not str(model_path).strip():
            raise ValueError(f"extractor {name!r} needs a local model directory: set {MODEL_PATH_KEY}")
        return _model_extractor(name, str(model_path))
    extractor = EXTRACTORS.get(name, None)
    if extractor is None:
        raise ValueError(f"unknown extractor {name!r}; available extractors: {available_extractors()}")
    if model_path is not None:
        raise ValueError(f"{MODEL_PATH_KEY} is only read by the model extractors {list(MODEL_EXTRACTORS)}, "
                         f"not by {name!r}; unset it")
    return extractor


def _model_extractor(name: str, model_path: str) -> Extractor:
    if name == "ratescore":
        from grouprl.domains.radiology.rewards.backends.rate_ner import load_rate_ner

        ner = load_rate_ner(model_path)

        def rate_ner_extractor(response: str, reference: str) -> EntityMatching:
            hyp, ref = ner.extract([response, reference])
            return match_entities(hyp, ref, threshold=MATCH_THRESHOLD)

        return rate_ner_extractor

    from grouprl.domains.radiology.rewards.backends.radgraph_model import load_radgraph_model

    model = load_radgraph_model(model_path)

    def radgraph_extractor(response: str, reference: str) -> EntityMatching:
        hyp, ref = model.graphs([response, reference])
        return match_entities(_graph_entities(hyp, response), _graph_entities(ref, reference),
                              threshold=MATCH_THRESHOLD)

    return radgraph_extractor


def _graph_entities(graph: ReportGraph, text: str) -> tuple[RateEntity, ...]:
    """A model graph's entities with ``sentence``/``start``/``end`` of ``text`` (the report it was run on).

    The RadGraph package annotates its own tokens joined by spaces ("effusion ." for
    "effusion."), so its sentences need not be the report's. Offsets are mapped by
    counting non-space characters, which tokenization keeps; when the graph's text is
    not the report's up to whitespace and case, the entities are kept with their
    sentence index clamped to the report's sentences.
    """
    entities = rate_entities(graph)
    spans = sentence_spans(text)
    if not spans:
        return ()
    kept = [i for i, c in enumerate(text) if not c.isspace()]
    if "".join(text[i] for i in kept).lower() != "".join(graph.text.split()).lower():
        return tuple(e._replace(sentence=min(e.sentence, len(spans) - 1)) for e in entities)
    dense = [0] * (len(graph.text) + 1)  # graph offset -> non-space characters before it
    for i, c in enumerate(graph.text):
        dense[i + 1] = dense[i] + (not c.isspace())
    out = []
    for e in entities:
        first, last = dense[e.start], dense[e.end] - 1
        if last < first:  # an entity of spaces only: nothing to locate
            continue
        start, end = kept[first], kept[last] + 1
        sentence = next((k for k, (_, b) in enumerate(spans) if start < b), len(spans) - 1)
        out.append(e._replace(sentence=sentence, start=start, end=end))
    return tuple(out)


@register_extractor("rules")
def rules_extractor(response: str, reference: str) -> EntityMatching:
    """Rule-based RaTE-typed entities with character-trigram similarity (``ratescore.match_entities``)."""
    return match_entities(response, reference, threshold=MATCH_THRESHOLD)


# ----------------------------------------------------------------------------- sentences
_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE_END = (".", "!", "?")


def sentence_similarity(a: str, b: str) -> float:
    """Similarity of two sentences in [0, 1]; the measure ``tau`` is compared with.

    ``ratescore.text_similarity`` (cosine of character-trigram plus whole-word count
    vectors) of the lowercased words, so case and punctuation do not count. Offline,
    unlike EditGRPO's sentence embeddings; identical sentences score 1.0 exactly.
    """
    na = " ".join(_WORD.findall(a.lower()))
    nb = " ".join(_WORD.findall(b.lower()))
    if na == nb:
        return 1.0
    if not na or not nb:
        return 0.0
    return text_similarity(na, nb)


def _parse(text: str) -> tuple[list[str], list[str]]:
    """The sentences (as ``split_sentences``) and the whitespace between consecutive ones."""
    spans = sentence_spans(text)
    sentences = [text[a:b] for a, b in spans]
    gaps = [text[spans[i][1]:spans[i + 1][0]] for i in range(len(spans) - 1)]
    return sentences, gaps


def _render(sentences: list[str], gaps: list[str]) -> str:
    """Join sentences so that ``split_sentences`` of the result gives them back unchanged.

    Untouched sentences keep their original spacing. A sentence without final
    punctuation is only split from the next one by a newline, so a space after it
    becomes a newline (otherwise an added sentence would merge into it).
    """
    parts = []
    for i, sentence in enumerate(sentences):
        parts.append(sentence)
        if i < len(gaps):
            gap = gaps[i]
            if not sentence.endswith(_SENTENCE_END) and "\n" not in gap:
                gap = "\n"
            parts.append(gap)
    return "".join(parts)


def _choice(rng: random.Random, items: list):
    return items[rng.randrange(len(items))]


def _next_operation(sentences: list[str], gaps: list[str], ref_sentences: list[str], matching: EntityMatching,
                    tau: float, rng: random.Random) -> tuple[EditOperation, list[str], list[str]] | None:
    """The highest-priority operation on the report and the report after it; None when nothing is left."""
    if not sentences:
        # every reference entity is a false negative here; prefer sentences that hold one
        held = sorted({e.sentence for e in matching.false_negatives})
        candidates = held or list(range(len(ref_sentences)))
        if not candidates:
            return None
        after = ref_sentences[_choice(rng, candidates)]
        return EditOperation("fill", "", after, 0), [after], []

    present = set(sentences)
    contradictions = sorted({(p.hyp.sentence, p.ref.sentence) for p in matching.contradictions})
    if contradictions:
        i, j = _choice(rng, contradictions)
        after = ref_sentences[j]
        if after in present:
            # the reference's statement is already in the report: drop the contradicting one
            # instead of writing the same sentence twice
            return EditOperation("correct", sentences[i], "", i), *_delete(sentences, gaps, i)
        return EditOperation("correct", sentences[i], after, i), _replace(sentences, i, after), gaps

    fp_sentences = sorted({e.sentence for e in matching.false_positives})
    if fp_sentences:
        i = _choice(rng, fp_sentences)
        # reference sentences already in the report are no candidates: a replacement
        # must not duplicate a sentence the report already has
        scored = [(sentence_similarity(sentences[i], r), r) for r in dict.fromkeys(ref_sentences) if r not in present]
        best = max((s for s, _ in scored), default=0.0)
        if scored and best >= tau:
            after = _choice(rng, [r for s, r in scored if s == best])
            return EditOperation("replace", sentences[i], after, i), _replace(sentences, i, after), gaps
        return EditOperation("delete", sentences[i], "", i), *_delete(sentences, gaps, i)

    missing = sorted({e.sentence for e in matching.false_negatives if ref_sentences[e.sentence] not in present})
    if missing:
        after = ref_sentences[_choice(rng, missing)]
        return EditOperation("add", "", after, len(sentences)), sentences + [after], gaps + [" "]
    return None


def _replace(sentences: list[str], i: int, new: str) -> list[str]:
    return sentences[:i] + [new] + sentences[i + 1:]


def _delete(sentences: list[str], gaps: list[str], i: int) -> tuple[list[str], list[str]]:
    # drop the gap after the sentence, or the one before it when it was the last
    g = i if i < len(gaps) else i - 1
    kept_gaps = gaps[:g] + gaps[g + 1:] if g >= 0 else gaps
    return sentences[:i] + sentences[i + 1:], kept_gaps


def edit_report(response: str, reference: str, *, num_ops: int = 1, tau: float = 0.6, seed: int = 0,
                extractor: str | Extractor = "rules", extractor_model_path: str | None = None) -> EditResult:
    """Correct up to ``num_ops`` sentences of ``response`` against ``reference`` (see the module docstring).

    ``tau`` is the :func:`sentence_similarity` a false-positive sentence's best
    reference sentence needs for ``replace`` (at least ``tau``) rather than ``delete``.
    A response that agrees with its reference (every entity matched, none missing)
    gets no operation and comes back unchanged, character for character. An empty
    reference leaves the response unchanged: there is nothing to edit against.
    Deleting the only sentence of a report leaves it empty; a further operation
    (``num_ops`` > 1) then fills it. ``extractor`` is a name for :func:`build_extractor`
    (with ``extractor_model_path`` for a model extractor) or an extractor itself.
    """
    if not isinstance(response, str) or not isinstance(reference, str):
        raise TypeError("edit_report needs a response and a reference text")
    if not isinstance(num_ops, int) or num_ops < 0:
        raise ValueError(f"num_ops must be a non-negative integer, got {num_ops!r}")
    if not (isinstance(tau, (int, float)) and 0.0 <= tau <= 1.0):
        raise ValueError(f"tau must be in [0, 1], got {tau!r}")
    extract = extractor if callable(extractor) else build_extractor(extractor, extractor_model_path)
    ref_sentences = split_sentences(reference)
    if not ref_sentences:
        return EditResult(response, [])
    rng = random.Random(seed)
    sentences, gaps = _parse(response)
    operations: list[EditOperation] = []
    text = response
    for _ in range(num_ops):
        step = _next_operation(sentences, gaps, ref_sentences, extract(text, reference), tau, rng)
        if step is None:
            break
        operation, sentences, gaps = step
        operations.append(operation)
        text = _render(sentences, gaps)
    return EditResult(text, operations)


# ----------------------------------------------------------------------------- the transform
class EditTransform:
    """EditGRPO's post-rollout edits as a rollout transform (``RolloutBatch -> RolloutBatch``).

    Each row's reference is ``batch.samples[i].answer``; rows without one are never
    edited. In order:

    1. ``force_gt_num=k``: k groups (seeded, among those with a reference) get one
       random row overwritten with that group's own reference report.
    2. ``num_para=-1`` (the paper): in each group, with m rows not taken by step 1,
       floor(m/2) *source* rows are edited and each edited copy overwrites a distinct
       *target* row of the same group, so the group keeps its size: sources keep
       their response, targets hold the edited copies, any other rows are untouched.
       The group's free rows are shuffled (seeded); sources are the first rows in
       that order whose edit applies at least one operation (a copy of an unchanged
       response would only destroy a genuine sample), targets are the first of the
       remaining rows. A group with fewer editable rows gets fewer copies.
       ``num_para=k > 0``: k rows of the whole batch (seeded, among the editable
       ones outside step 1) are edited in place. ``num_para=0``: no sentence edits.
    3. Changed rows are re-tokenized (``tokenizer(text, add_special_tokens=False)``
       then ``eos_token_id``), right-padded with ``pad_token_id``; the batch widens
       when an edited response is longer and drops columns no row uses. Their
       ``truncated`` is False, ``edited`` True, and ``loss_mask`` is their new
       ``response_mask`` (``edited_tokens="train"``, the paper) or all zero
       (``edited_tokens="mask"``: edited tokens stay out of the loss, the row still
       counts in its group's reward baseline).

    Stale values: when any row changed, ``old_log_probs``, ``ref_log_probs``,
    ``advantages``, ``scores`` and ``reward_components`` are dropped (the trainer
    recomputes them from the edited tokens); ``rollout_log_probs`` (the sampler's
    own, for logs) is kept for unchanged rows and NaN on changed rows, which the
    sampler never produced: consumers must skip rows with ``edited`` set.

    Per-row ``extras``: ``edit_operations`` (list of ``EditOperation.to_dict()``;
    ``force_gt`` rows hold one ``{"type": "force_gt", ...}``; [] when unchanged) and
    ``edit_source`` (the row the edited text was derived from: another row for a
    num_para=-1 copy, the row itself for in-place edits, None for unchanged and
    force_gt rows). ``last_metrics`` holds the call's ``edits/edit_rate`` (rows this
    transform changed / rows), ``edits/op_<type>`` counts and ``edits/force_gt``.

    Randomness: one ``random.Random`` per call seeded from ``seed`` and the batch's
    content (ids, groups, responses), so a call is a pure function of its batch and
    a resumed run repeats the same edits on the same samples.
    """

    # counts add up over processes; edit_rate (a share of rows) is averaged by rows
    metric_kinds = {"edits/force_gt": "sum", **{f"edits/op_{t}": "sum" for t in OPERATION_TYPES}}

    def __init__(self, processor, *, eos_token_id: int, pad_token_id: int, num_ops_per_para: int = 1,
                 num_para: int = -1, tau: float = 0.6, force_gt_num: int = 0, seed: int = 0,
                 extractor: str = "rules", extractor_model_path: str | None = None,
                 edited_tokens: str = "train") -> None:
        if not isinstance(num_para, int) or num_para < -1:
            raise ValueError(f"num_para must be -1 (floor(n/2) copies per group), 0 or a positive integer, got {num_para!r}")
        if not isinstance(force_gt_num, int) or force_gt_num < 0:
            raise ValueError(f"force_gt_num must be a non-negative integer, got {force_gt_num!r}")
        if not isinstance(num_ops_per_para, int) or num_ops_per_para < 0:
            raise ValueError(f"num_ops_per_para must be a non-negative integer, got {num_ops_per_para!r}")
        if not 0.0 <= tau <= 1.0:
            raise ValueError(f"tau must be in [0, 1], got {tau!r}")
        if edited_tokens not in ("train", "mask"):
            raise ValueError(f"edited_tokens must be 'train' or 'mask', got {edited_tokens!r}")
        # fail (and load a model) at construction, not at the first step
        self._extract = build_extractor(extractor, extractor_model_path)
        self.tokenizer = tokenizer_of(processor)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.num_ops_per_para = num_ops_per_para
        self.num_para = num_para
        self.tau = float(tau)
        self.force_gt_num = force_gt_num
        self.seed = seed
        self.extractor = extractor
        self.extractor_model_path = extractor_model_path
        self.edited_tokens = edited_tokens
        self.last_metrics: dict[str, float] = {}

    @property
    def group_local(self) -> bool:
        """Whether each group's edits depend on that group alone (so a batch may be edited in parts).

        ``num_para=-1`` edits within each group; ``num_para=k > 0`` and ``force_gt_num``
        choose rows or groups across the whole batch.
        """
        return self.num_para <= 0 and self.force_gt_num == 0

    # -- choosing what to change

    def _rng(self, batch: RolloutBatch) -> random.Random:
        h = hashlib.blake2b(digest_size=8)
        h.update(str(self.seed).encode())
        for sample, group, response in zip(batch.samples, batch.group_index.tolist(), batch.responses):
            h.update(f"\x00{sample.id}\x00{group}\x00{response}".encode())
        return random.Random(int.from_bytes(h.digest(), "big"))

    def _edit(self, batch: RolloutBatch, row: int, rng: random.Random) -> EditResult:
        reference = batch.samples[row].answer
        if not reference or not reference.strip():
            return EditResult(batch.responses[row], [])
        return edit_report(batch.responses[row], reference, num_ops=self.num_ops_per_para, tau=self.tau,
                           seed=rng.randrange(2**32), extractor=self._extract)

    def _first_editable(self, batch, rows: list[int], count: int, rng) -> list[tuple[int, EditResult]]:
        found = []
        for row in rows:
            if len(found) == count:
                break
            result = self._edit(batch, row, rng)
            if result.operations:
                found.append((row, result))
        return found

    def plan(self, batch: RolloutBatch) -> dict[int, tuple[str, list[dict], int | None]]:
        """``{row: (new text, operations, source row)}`` for every row this call changes."""
        rng = self._rng(batch)
        groups: dict[int, list[int]] = {}
        for row, g in enumerate(batch.group_index.tolist()):
            groups.setdefault(g, []).append(row)
        changes: dict[int, tuple[str, list[dict], int | None]] = {}

        if self.force_gt_num:
            with_reference = [g for g, rows in groups.items() if (batch.samples[rows[0]].answer or "").strip()]
            for g in rng.sample(with_reference, min(self.force_gt_num, len(with_reference))):
                row = _choice(rng, groups[g])
                # the row's own sample: every row of a group answers the same prompt
                reference = batch.samples[row].answer
                op = {"type": FORCE_GT, "before": batch.responses[row], "after": reference, "sentence_index": None}
                changes[row] = (reference, [op], None)

        if self.num_para == -1:
            for rows in groups.values():
                free = [r for r in rows if r not in changes]
                rng.shuffle(free)
                edits = self._first_editable(batch, free, len(free) // 2, rng)
                sources = {r for r, _ in edits}
                targets = [r for r in free if r not in sources]
                for (source, result), target in zip(edits, targets):
                    changes[target] = (result.text, [op.to_dict() for op in result.operations], source)
        elif self.num_para > 0:
            free = [r for r in range(len(batch)) if r not in changes]
            rng.shuffle(free)
            for row, result in self._first_editable(batch, free, self.num_para, rng):
                changes[row] = (result.text, [op.to_dict() for op in result.operations], row)
        return changes

    # -- rebuilding the batch

    def __call__(self, batch: RolloutBatch) -> RolloutBatch:
        changes = self.plan(batch)
        n = len(batch)
        operations = list(batch.extras.get("edit_operations", [[] for _ in range(n)]))
        sources = list(batch.extras.get("edit_source", [None] * n))
        for row, (_, ops, source) in changes.items():
            operations[row], sources[row] = ops, source
        extras = {**batch.extras, "edit_operations": operations, "edit_source": sources}
        self.last_metrics = self._metrics(changes, n)
        if not changes:
            return replace(batch, extras=extras)

        encoded = {row: self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_token_id]
                   for row, (text, _, _) in changes.items()}
        width = max(batch.response_ids.shape[1], max(len(ids) for ids in encoded.values()))

        def widen(t: torch.Tensor, value) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

        response_ids = widen(batch.response_ids, self.pad_token_id)
        response_mask = widen(batch.response_mask, 0)
        policy_mask = widen(batch.policy_mask, 0)
        loss_mask = widen(batch.loss_mask, 0)
        rollout_log_probs = None if batch.rollout_log_probs is None else widen(batch.rollout_log_probs, 0.0)
        truncated = batch.truncated.clone()
        edited = batch.edited.clone()
        responses = list(batch.responses)
        for row, ids in encoded.items():
            length = len(ids)
            response_ids[row] = self.pad_token_id
            response_ids[row, :length] = torch.tensor(ids, dtype=response_ids.dtype)
            response_mask[row] = 0
            response_mask[row, :length] = 1
            policy_mask[row] = response_mask[row]  # stands where the policy's response stood
            loss_mask[row] = response_mask[row] if self.edited_tokens == "train" else 0
            if rollout_log_probs is not None:
                rollout_log_probs[row] = math.nan  # not the sampler's tokens any more
            truncated[row] = False
            edited[row] = True
            responses[row] = changes[row][0]
        # columns no row uses any more (the longest response was overwritten) cost compute only
        keep = int(response_mask.sum(-1).max())
        return replace(
            batch,
            response_ids=response_ids[:, :keep],
            response_mask=response_mask[:, :keep],
            policy_mask=policy_mask[:, :keep],
            loss_mask=loss_mask[:, :keep],
            rollout_log_probs=None if rollout_log_probs is None else rollout_log_probs[:, :keep],
            responses=responses,
            truncated=truncated,
            edited=edited,
            extras=extras,
            old_log_probs=None,
            ref_log_probs=None,
            advantages=None,
            scores=None,
            reward_components={},
        )

    @staticmethod
    def _metrics(changes: dict, rows: int) -> dict[str, float]:
        counts = {t: 0 for t in OPERATION_TYPES}
        force_gt = 0
        for _, ops, _ in changes.values():
            for op in ops:
                if op["type"] == FORCE_GT:
                    force_gt += 1
                else:
                    counts[op["type"]] += 1
        metrics = {"edits/edit_rate": len(changes) / rows if rows else 0.0, "edits/force_gt": float(force_gt)}
        metrics.update({f"edits/op_{t}": float(c) for t, c in counts.items()})
        return metrics


@register_rollout_transform("editgrpo_edits")
def edit_transform_from_config(config, *, processor, engine) -> EditTransform | None:
    """EditGRPO's edits as the config asks for them (``worker.rollout.extractor*``,
    ``algorithm.force_gt_num``), or None when both are off.

    Edited copies join their group after generation and before rewards, so their old
    log-probs come from the actor like any other row's.
    """
    roll, algorithm = config.worker.rollout, config.algorithm
    if not (roll.extractor or algorithm.force_gt_num > 0):
        return None
    return EditTransform(
        processor, eos_token_id=end_of_turn_id(processor), pad_token_id=engine.pad_token_id,
        num_ops_per_para=roll.extractor_num_ops_per_para, num_para=roll.extractor_num_para if roll.extractor else 0,
        tau=roll.extractor_similarity_threshold, force_gt_num=algorithm.force_gt_num, seed=config.trainer.seed,
        extractor=roll.extractor_type, extractor_model_path=roll.extractor_model_path,
        edited_tokens=roll.extractor_edited_tokens)
