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

from grouprl.rewards.radiology.components import register_component
from grouprl.rewards.radiology.entities import BACKEND, ReportGraph, graph_of

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


def _batch(hyps: list[str], refs: list[str], level: str) -> list[float]:
    return [radgraph_f1(h, r, level) for h, r in zip(hyps, refs)]


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
    return [radgraph_scores(h, r)["partial"][0] for h, r in zip(hyps, refs)]


@register_component("radgraph_recall", backend=BACKEND,
                    description="RadGraph-style recall, partial level (EditGRPO's recall_radgraph_scores)")
def radgraph_recall_component(hyps: list[str], refs: list[str]) -> list[float]:
    return [radgraph_scores(h, r)["partial"][1] for h, r in zip(hyps, refs)]
