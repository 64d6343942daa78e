"""RadGraph-style F1 between a generated report's graph and the reference's.

Three levels, each an F1 over sets of keys, one key per entity:

- ``simple``: the entity's text;
- ``partial``: its text and label (``effusion``/``OBS-DA`` differs from
  ``effusion``/``OBS-DP``, so a negation flip costs) -- EditGRPO's reward;
- ``complete``: text, label and the set of its outgoing relations, each as
  (relation type, target text, target label); an entity matches only when all of
  its relations match too.

Per report: precision = |H & R| / |H|, recall = |H & R| / |R|, F1 their harmonic
mean; two empty graphs score 1.0 (nothing to find, nothing claimed), one empty
graph scores 0.0. Sets, as RadGraph's F1 uses, so repeating a sentence neither adds
nor costs. The corpus score averages the per-report F1, as the papers report it.

Graphs come from the rule-based extractor (``radgraph=rules``), not the RadGraph
model; every score says so.
"""

from __future__ import annotations

from collections.abc import Sequence

from grouprl.domains.radiology.rewards.batch_parses import batch_cached, batch_scope
from grouprl.domains.radiology.rewards.components import register_component
from grouprl.domains.radiology.rewards.entities import BACKEND, ReportGraph, graph_of

LEVELS = ("simple", "partial", "complete")


def entity_keys(graph: ReportGraph, level: str) -> set:
    """The set an F1 at ``level`` compares: one key per entity (duplicates collapse)."""
    entities = graph.entities
    if level == "simple":
        return {e.text for e in entities}
    if level == "partial":
        return {(e.text, e.label) for e in entities}
    if level == "complete":
        outgoing: list[list] = [[] for _ in entities]
        for r in graph.relations:
            target = entities[r.target]
            outgoing[r.source].append((r.type, target.text, target.label))
        return {(e.text, e.label, frozenset(outgoing[e.id])) for e in entities}
    raise ValueError(f"unknown RadGraph F1 level {level!r}; choose one of {', '.join(LEVELS)}")


def _prf(hyp: set, ref: set) -> tuple[float, float, float]:
    if not hyp and not ref:
        return (1.0, 1.0, 1.0)
    if not hyp or not ref:
        return (0.0, 0.0, 0.0)
    common = len(hyp & ref)
    p, r = common / len(hyp), common / len(ref)
    return (p, r, 2 * p * r / (p + r) if common else 0.0)


def _graph(report: str | ReportGraph) -> ReportGraph:
    return report if isinstance(report, ReportGraph) else graph_of(report)


def radgraph_scores(hyp_graph: str | ReportGraph, ref_graph: str | ReportGraph) -> dict[str, tuple[float, float, float]]:
    """``{"simple": (p, r, f1), "partial": (...), "complete": (...)}`` for one pair (graphs or texts)."""
    hyp, ref = _graph(hyp_graph), _graph(ref_graph)
    return {level: _prf(entity_keys(hyp, level), entity_keys(ref, level)) for level in LEVELS}


def radgraph_f1(hyp: str | ReportGraph, ref: str | ReportGraph, level: str = "partial") -> float:
    """The F1 of one pair at one level."""
    return _prf(entity_keys(_graph(hyp), level), entity_keys(_graph(ref), level))[2]


def radgraph_corpus_f1(hyps: Sequence[str], refs: Sequence[str]) -> dict:
    """Mean per-report precision, recall and F1 at each level over a test set.

    Keys: ``simple``, ``partial``, ``complete`` (mean F1), ``<level>_precision``,
    ``<level>_recall``, ``n`` and ``backend``.
    """
    if len(hyps) != len(refs):
        raise ValueError(f"got {len(hyps)} hypotheses for {len(refs)} references")
    n = len(hyps)
    sums = {level: [0.0, 0.0, 0.0] for level in LEVELS}
    for hyp, ref in zip(hyps, refs):
        for level, prf in radgraph_scores(hyp, ref).items():
            acc = sums[level]
            for i in range(3):
                acc[i] += prf[i]
    out: dict = {}
    for level in LEVELS:
        p, r, f = (v / n if n else 0.0 for v in sums[level])
        out[level] = f
        out[f"{level}_precision"] = p
        out[f"{level}_recall"] = r
    out["n"] = n
    out["backend"] = BACKEND
    return out


# Separators of the fields of a key kept as one string: entity texts and labels are lexicon
# terms and label names, which hold no control characters.
_FIELD, _RELATION, _RELATION_FIELD = "\x1f", "\x1e", "\x1d"


def key_strings(graph: ReportGraph, level: str) -> frozenset[str]:
    """:func:`entity_keys` of ``graph`` with each key one string (its fields joined by separators that
    no entity text or label holds): two strings are equal exactly when their keys are, so F1 is unchanged.

    Why strings: a batch keeps each text's keys until it ends, and the ~20 small tuples of
    a report would each count towards the garbage collector's thresholds (a full collection
    every few thousand texts); a string is not tracked by it.
    """
    entities = graph.entities
    if level == "simple":
        return frozenset([e.text for e in entities])
    if level == "partial":
        return frozenset([e.text + _FIELD + e.label for e in entities])
    if level == "complete":
        outgoing: list[set[str]] = [set() for _ in entities]
        for r in graph.relations:
            target = entities[r.target]
            outgoing[r.source].add(r.type + _RELATION_FIELD + target.text + _RELATION_FIELD + target.label)
        return frozenset([e.text + _FIELD + e.label + _FIELD + _RELATION.join(sorted(outgoing[e.id]))
                          for e in entities])
    raise ValueError(f"unknown RadGraph F1 level {level!r}; choose one of {', '.join(LEVELS)}")


def _text_keys_at(level: str):
    """``text -> key_strings(graph_of(text), level)`` cached in the batch scope: one cache per
    level, so that the text alone is the key (a (text, level) tuple per text would be one more
    object for the garbage collector to count)."""

    @batch_cached
    def keys(text: str) -> frozenset[str]:
        return key_strings(graph_of(text), level)

    keys.__name__ = keys.__qualname__ = f"text_entity_keys_{level}"
    return keys


_TEXT_KEYS = {level: _text_keys_at(level) for level in LEVELS}


def text_entity_keys(text: str, level: str) -> frozenset[str]:
    """:func:`key_strings` of a text's graph, once per distinct text and level of a batch."""
    keys = _TEXT_KEYS.get(level)
    if keys is None:
        raise ValueError(f"unknown RadGraph F1 level {level!r}; choose one of {', '.join(LEVELS)}")
    return keys(text)


def _batch(hyps: list[str], refs: list[str], level: str, which: int = 2) -> list[float]:
    """Element ``which`` (0 precision, 1 recall, 2 F1) of every pair's scores at ``level``.

    Only the key sets are kept for the batch: comparing two of them costs less than
    keeping every pair's result would (in memory and in garbage-collector work).
    """
    with batch_scope():
        return [_prf(text_entity_keys(h, level), text_entity_keys(r, level))[which] for h, r in zip(hyps, refs)]


@register_component("radgraphf1", backend=BACKEND,
                    description="RadGraph-style F1, partial level (entity text + label); EditGRPO's reward")
def radgraph_partial_component(hyps: list[str], refs: list[str]) -> list[float]:
    return _batch(hyps, refs, "partial")


@register_component("radgraph_simple", backend=BACKEND,
                    description="RadGraph-style F1, simple level (entity text only)")
def radgraph_simple_component(hyps: list[str], refs: list[str]) -> list[float]:
    return _batch(hyps, refs, "simple")


@register_component("radgraph_complete", backend=BACKEND,
                    description="RadGraph-style F1, complete level (entity text + label + relations)")
def radgraph_complete_component(hyps: list[str], refs: list[str]) -> list[float]:
    return _batch(hyps, refs, "complete")


@register_component("radgraph_precision", backend=BACKEND,
                    description="RadGraph-style precision, partial level (EditGRPO's precision_radgraph_scores)")
def radgraph_precision_component(hyps: list[str], refs: list[str]) -> list[float]:
    return _batch(hyps, refs, "partial", 0)


@register_component("radgraph_recall", backend=BACKEND,
                    description="RadGraph-style recall, partial level (EditGRPO's recall_radgraph_scores)")
def radgraph_recall_component(hyps: list[str], refs: list[str]) -> list[float]:
    return _batch(hyps, refs, "partial", 1)
