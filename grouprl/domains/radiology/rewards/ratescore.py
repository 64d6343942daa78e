"""A RaTEScore-style entity-aware score, and the entity matching the post-rollout editor uses.

RaTEScore (Zhao et al. 2024) tags a report's entities with five types, embeds each
entity, matches every entity to its most similar counterpart in the other report
and combines precision- and recall-like weighted averages into an F-score. This is
the same shape with offline parts (``ratescore=rules-ngram``):

- Entities come from the rule-based graph (``entities.py``): an observation with its
  modifiers ("small effusion") and an anatomy phrase with its modifiers ("left lower
  lobe"). Types: ``DISEASE`` for disease names (pneumonia, heart failure),
  ``ABNORMALITY`` for other findings and devices present or uncertain, their
  ``NON-`` forms when negated, normal descriptors ("clear", "normal") as
  ``NON-ABNORMALITY``, and ``ANATOMY``. Uncertain counts as present (the five types
  carry no certainty).
- Similarity: cosine of character-trigram count vectors (each word padded with
  ``<`` ``>``) plus a whole-word feature of weight 2, instead of BioLORD embeddings,
  which need hub weights. Cheap, and it gives graded credit ("small effusion" vs
  "effusion" 0.76, "left pleura" vs "right pleura" 0.54) rather than all or nothing.
  Identical texts are 1.0 exactly.
- Each entity's score is ``max over the other report's entities of similarity x
  affinity(type pair)``: same type 1.0, the other type of the same polarity 0.5
  (ABNORMALITY ~ DISEASE), opposite polarity 0.0 (a negation flip earns nothing),
  anatomy vs observation 0.0.
- Precision = weighted mean of the generated report's entity scores, recall = the
  same over the reference's; weights: ABNORMALITY and DISEASE 1.0, NON-* and
  ANATOMY 0.5, since a missed or invented abnormality matters more than a missed
  "no pneumothorax". Score = 2PR / (P + R); two reports without entities score 1.0,
  one without 0.0.

:func:`match_entities` turns the same similarities into decisions for the editor
and the ``/analyze`` endpoint. Unlike EditGRPO's public code (cosine times affinity
compared with an absolute threshold, where identical same-type entities can fail to
match), same-type affinity is 1.0 and identical texts have similarity 1.0, so an
entity present in both reports always matches, at any threshold up to 1.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from grouprl.domains.radiology.rewards.components import register_component
from grouprl.domains.radiology.rewards.entities import ANAT_DP, OBS_DA, ReportGraph, graph_of

BACKEND = "ratescore=rules-ngram"

ABNORMALITY = "ABNORMALITY"
NON_ABNORMALITY = "NON-ABNORMALITY"
DISEASE = "DISEASE"
NON_DISEASE = "NON-DISEASE"
ANATOMY = "ANATOMY"
RATE_TYPES = (ABNORMALITY, NON_ABNORMALITY, DISEASE, NON_DISEASE, ANATOMY)

TYPE_WEIGHTS = {ABNORMALITY: 1.0, DISEASE: 1.0, NON_ABNORMALITY: 0.5, NON_DISEASE: 0.5, ANATOMY: 0.5}

_POSITIVE = {ABNORMALITY, DISEASE}
_NEGATIVE = {NON_ABNORMALITY, NON_DISEASE}


def affinity(a: str, b: str) -> float:
    """How much a similarity between entities of types ``a`` and ``b`` counts."""
    if a == b:
        return 1.0
    if (a in _POSITIVE and b in _POSITIVE) or (a in _NEGATIVE and b in _NEGATIVE):
        return 0.5
    return 0.0  # opposite polarity, or anatomy against an observation


def opposite_polarity(a: str, b: str) -> bool:
    return (a in _POSITIVE and b in _NEGATIVE) or (a in _NEGATIVE and b in _POSITIVE)


class RateEntity(NamedTuple):  # a NamedTuple: immutable and cheap to build
    text: str  # modifiers + head, e.g. "small effusion", "left lower lobe"
    head: str  # the observation or anatomy itself, e.g. "effusion": what a contradiction is about
    type: str  # one of RATE_TYPES
    sentence: int  # index into entities.split_sentences(report)
    start: int
    end: int

    def to_dict(self) -> dict:
        return {"text": self.text, "head": self.head, "type": self.type, "sentence": self.sentence,
                "start": self.start, "end": self.end}


# ``_tuple_new(RateEntity, fields)`` is what ``RateEntity(*fields)`` runs, without the generated
# ``__new__``'s Python frame (entities_from_graph builds one per entity of every new report).
_tuple_new = tuple.__new__


def _rate_type(category: str, label: str) -> str:
    negated = label == OBS_DA
    if category == "disease":
        return NON_DISEASE if negated else DISEASE
    if category == "normal":
        # "the heart is not normal" reports an abnormality
        return ABNORMALITY if negated else NON_ABNORMALITY
    return NON_ABNORMALITY if negated else ABNORMALITY


def entities_from_graph(graph: ReportGraph) -> tuple[RateEntity, ...]:
    """Observation and anatomy phrases of a graph, each folded with its modifiers.

    Modifiers go before the head in the order they were written, whichever side of
    it they stood on, so "the effusion is small" and "small effusion" give one text.
    """
    ents = graph.entities
    modifiers: dict[int, list[int]] = {}
    for r in graph.relations:
        if r.type == "modify":
            modifiers.setdefault(r.target, []).append(r.source)
    folded = {m for ms in modifiers.values() for m in ms}
    out = []
    for e in ents:
        if e.id in folded:
            continue
        kind = ANATOMY if e.label == ANAT_DP else _rate_type(e.category, e.label)
        parts = modifiers.get(e.id)
        if parts is None:
            out.append(_tuple_new(RateEntity, (e.text, e.text, kind, e.sentence, e.start, e.end)))
            continue
        parts = sorted(parts)  # ids are in reading order
        text = " ".join([ents[i].text for i in parts] + [e.text])
        start = min(e.start, ents[parts[0]].start)
        end = max(e.end, max(ents[i].end for i in parts))
        out.append(_tuple_new(RateEntity, (text, e.text, kind, e.sentence, start, end)))
    return tuple(out)


@lru_cache(maxsize=8192)
def _entities_of_text(text: str) -> tuple[RateEntity, ...]:
    return entities_from_graph(graph_of(text))


def rate_entities(report: str | ReportGraph | Sequence[RateEntity]) -> tuple[RateEntity, ...]:
    """The RaTE-typed entities of a report (text, cached), of an extracted graph, or
    already extracted (a sequence of :class:`RateEntity`, e.g. RaTE-NER's), passed through as a tuple."""
    if isinstance(report, ReportGraph):
        return entities_from_graph(report)
    if isinstance(report, str):
        return _entities_of_text(report)
    if isinstance(report, (tuple, list)):
        for i, e in enumerate(report):
            if not isinstance(e, RateEntity):
                raise TypeError(f"entity {i} must be a RateEntity, got {type(e).__name__}")
        return tuple(report)
    raise TypeError(f"expected a report text, a ReportGraph or a sequence of RateEntity, got {type(report).__name__}")


@lru_cache(maxsize=32768)
def _profile(text: str) -> tuple[dict[str, int], float]:
    grams: Counter = Counter()
    for word in text.split():
        padded = f"<{word}>"
        for i in range(len(padded) - 2):
            grams[padded[i:i + 3]] += 1
        grams["w:" + word] += 2  # a whole shared word counts more than its trigrams alone
    return dict(grams), math.sqrt(sum(v * v for v in grams.values()))


@lru_cache(maxsize=65536)
def _similarity(a: str, b: str) -> float:
    va, na = _profile(a)
    vb, nb = _profile(b)
    if not na or not nb:
        return 0.0
    if len(va) > len(vb):
        va, vb = vb, va
    dot = sum(v * vb.get(g, 0) for g, v in va.items())
    return min(1.0, dot / (na * nb))


def text_similarity(a: str, b: str) -> float:
    """Cosine of character-trigram (+ word) count vectors; 1.0 exactly for equal texts."""
    if a == b:
        return 1.0
    return _similarity(a, b) if a < b else _similarity(b, a)


def _best(entity: RateEntity, others: Sequence[RateEntity]) -> tuple[float, int]:
    best, where = 0.0, -1
    for j, other in enumerate(others):
        weight = affinity(entity.type, other.type)
        if weight == 0.0:
            continue
        s = text_similarity(entity.text, other.text) * weight
        if s > best:
            best, where = s, j
            if s >= 1.0:
                break
    return best, where


_AFFINITY = {(a, b): affinity(a, b) for a in RATE_TYPES for b in RATE_TYPES}


def _weighted_mean(entities: Sequence[RateEntity], others: Sequence[RateEntity]) -> float:
    """Weighted mean over ``entities`` of their best similarity x affinity in ``others``."""
    by_type: dict[str, set[str]] = {}
    for o in others:
        by_type.setdefault(o.type, set()).add(o.text)
    memo: dict[tuple[str, str], float] = {}  # reports repeat entities; score each (text, type) once
    total = weight_sum = 0.0
    for e in entities:
        key = (e.text, e.type)
        best = memo.get(key)
        if best is None:
            best = 0.0
            for other_type, texts in by_type.items():
                weight = _AFFINITY[e.type, other_type]
                if weight <= best:  # cannot beat what we have (and skips affinity 0)
                    continue
                if e.text in texts:
                    best = weight
                    continue
                for t in texts:
                    s = text_similarity(e.text, t) * weight
                    if s > best:
                        best = s
            memo[key] = best
        w = TYPE_WEIGHTS[e.type]
        total += w * best
        weight_sum += w
    return total / weight_sum


def ratescore(hyp: str | ReportGraph, ref: str | ReportGraph) -> float:
    """The RaTEScore-style F-score of a generated report against its reference, in [0, 1]."""
    h, r = rate_entities(hyp), rate_entities(ref)
    if not h and not r:
        return 1.0
    if not h or not r:
        return 0.0
    p, rec = _weighted_mean(h, r), _weighted_mean(r, h)
    return 2 * p * rec / (p + rec) if p + rec else 0.0


@register_component("ratescore", backend=BACKEND,
                    description="RaTEScore-style entity-aware F-score (typed entities, char-trigram similarity)")
def ratescore_component(hyps: list[str], refs: list[str]) -> list[float]:
    return [ratescore(h, r) for h, r in zip(hyps, refs)]


# ----------------------------------------------------------------------------- matching
class EntityMatch(NamedTuple):
    hyp: RateEntity
    ref: RateEntity | None
    similarity: float  # similarity x affinity for a match, head similarity for a contradiction
    relation: str  # "match" | "contradiction" | "fp"

    def to_dict(self) -> dict:
        return {"hyp": self.hyp.to_dict(), "ref": self.ref.to_dict() if self.ref else None,
                "similarity": self.similarity, "relation": self.relation}


@dataclass(frozen=True)
class EntityMatching:
    """Every generated entity's decision (``pairs``), and the reference entities nobody found."""

    hyp_entities: tuple[RateEntity, ...]
    ref_entities: tuple[RateEntity, ...]
    pairs: tuple[EntityMatch, ...]
    false_negatives: tuple[RateEntity, ...]

    @property
    def matches(self) -> list[EntityMatch]:
        return [p for p in self.pairs if p.relation == "match"]

    @property
    def false_positives(self) -> list[RateEntity]:
        return [p.hyp for p in self.pairs if p.relation == "fp"]

    @property
    def contradictions(self) -> list[EntityMatch]:
        return [p for p in self.pairs if p.relation == "contradiction"]

    def to_dict(self) -> dict:
        return {
            "hyp_entities": [e.to_dict() for e in self.hyp_entities],
            "ref_entities": [e.to_dict() for e in self.ref_entities],
            "pairs": [p.to_dict() for p in self.pairs],
            "false_positives": [e.to_dict() for e in self.false_positives],
            "false_negatives": [e.to_dict() for e in self.false_negatives],
            "contradictions": [p.to_dict() for p in self.contradictions],
        }


def _contradiction(entity: RateEntity, others: Sequence[RateEntity], threshold: float) -> tuple[float, int]:
    """The other report's entity saying the opposite about the same observation, if any."""
    best, where = 0.0, -1
    for j, other in enumerate(others):
        if opposite_polarity(entity.type, other.type):
            s = text_similarity(entity.head, other.head)
            if s > best:
                best, where = s, j
    return (best, where) if best >= threshold else (best, -1)


def match_entities(hyp: str | ReportGraph | Sequence[RateEntity], ref: str | ReportGraph | Sequence[RateEntity], *,
                   threshold: float = 0.6) -> EntityMatching:
    """Match each generated entity to its best reference counterpart.

    A generated entity is a ``match`` when its best similarity x affinity reaches
    ``threshold``; else a ``contradiction`` when a reference entity of opposite
    polarity names the same observation (head similarity >= ``threshold``: "no
    effusion" against "small effusion"); else a false positive (``fp``). A reference
    entity is a false negative when no generated entity reaches ``threshold`` with
    it and it is not one side of a contradiction. Matching is many-to-one, as in
    RaTEScore. Identical entities always match (similarity 1.0). Either side may be a
    text, a :class:`ReportGraph` or an already extracted entity sequence (see :func:`rate_entities`).
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    h, r = rate_entities(hyp), rate_entities(ref)
    pairs = []
    contradicted: set[int] = set()
    for e in h:
        score, j = _best(e, r)
        if j >= 0 and score >= threshold:
            pairs.append(EntityMatch(e, r[j], score, "match"))
            continue
        head_sim, k = _contradiction(e, r, threshold)
        if k >= 0:
            contradicted.add(k)
            pairs.append(EntityMatch(e, r[k], head_sim, "contradiction"))
        else:
            pairs.append(EntityMatch(e, None, score, "fp"))
    false_negatives = tuple(
        e for j, e in enumerate(r) if j not in contradicted and _best(e, h)[0] < threshold
    )
    return EntityMatching(h, r, tuple(pairs), false_negatives)
