"""A report's graph as a knowledge graph, and CheXPO-v2's knowledge-graph consistency reward.

CheXPO-v2 extracts a knowledge graph (typed entities, relation triples) from the
model's reasoning and from the reference reasoning and rewards

    (IoU of the (entity, type) sets + IoU of the (source, target, relation) sets) / 2,

each IoU 1.0 when both sets are empty. Its extractor follows ReXKG's entity types;
the graph here comes from the rule-based extractor (``entities.py``) with its labels
mapped to those types:

- ``ANAT-DP`` -> ``anatomy``;
- ``OBS-DP`` -> ``disorder_present``, or ``device_present`` for a device;
- ``OBS-DA`` -> ``disorder_not_present`` / ``device_not_present``;
- ``OBS-U`` -> ``concept`` (ReXKG's type for what is neither asserted nor denied).

Sets, so a repeated statement counts once: the reward cannot be raised by repeating
a correct sentence.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from grouprl.domains.radiology.rewards.components import register_component
from grouprl.domains.radiology.rewards.entities import ANAT_DP, OBS_DA, OBS_U, Entity, ReportGraph, graph_of
from grouprl.rewards.contract import completion_text
from grouprl.rewards.registry import register_reward

BACKEND = "kg=rules"

KG_TYPES = ("anatomy", "disorder_present", "disorder_not_present", "concept", "device_present",
            "device_not_present")


def kg_type(entity: Entity) -> str:
    """The ReXKG-like type of a graph entity."""
    if entity.label == ANAT_DP:
        return "anatomy"
    if entity.label == OBS_U:
        return "concept"
    device = entity.category == "device"
    if entity.label == OBS_DA:
        return "device_not_present" if device else "disorder_not_present"
    return "device_present" if device else "disorder_present"


@dataclass(frozen=True)
class KnowledgeGraph:
    entities: frozenset[tuple[str, str]]  # (entity text, type)
    relations: frozenset[tuple[str, str, str]]  # (source text, target text, relation)

    @classmethod
    def from_graph(cls, graph: ReportGraph) -> KnowledgeGraph:
        ents = graph.entities
        return cls(
            frozenset((e.text, kg_type(e)) for e in ents),
            frozenset((ents[r.source].text, ents[r.target].text, r.type) for r in graph.relations),
        )


def knowledge_graph(report: str | ReportGraph) -> KnowledgeGraph:
    """The knowledge graph of a report text (cached) or of an extracted graph."""
    if isinstance(report, ReportGraph):
        return KnowledgeGraph.from_graph(report)
    return _kg_of(report)


@lru_cache(maxsize=8192)
def _kg_of(text: str) -> KnowledgeGraph:
    return KnowledgeGraph.from_graph(graph_of(text))


def iou(a: frozenset | set, b: frozenset | set) -> float:
    """|a & b| / |a | b|; 1.0 when both are empty (agreeing that there is nothing)."""
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def kg_consistency(hyp_text: str | ReportGraph, ref_text: str | ReportGraph) -> float:
    """(entity IoU + relation IoU) / 2 between the two reports' knowledge graphs."""
    hyp, ref = knowledge_graph(hyp_text), knowledge_graph(ref_text)
    return (iou(hyp.entities, ref.entities) + iou(hyp.relations, ref.relations)) / 2


@register_component("kg_consistency", backend=BACKEND,
                    description="knowledge-graph consistency: (entity IoU + relation IoU) / 2 (CheXPO-v2)")
def kg_consistency_component(hyps: list[str], refs: list[str]) -> list[float]:
    return [kg_consistency(h, r) for h, r in zip(hyps, refs)]


_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL | re.IGNORECASE)


def reasoning_span(text: str) -> str:
    """The ``<think>...</think>`` content when there is one, else the whole text."""
    m = _THINK.search(text)
    return m.group(1).strip() if m else text


@register_reward("kg_consistency")
def kg_consistency_reward(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    *,
    answer: Sequence[Any] | None = None,
    reasoning: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """CheXPO-v2's process reward: :func:`kg_consistency` between the completion's
    reasoning (its ``<think>`` span, else the whole completion) and the reference
    reasoning (the ``reasoning`` column; per row, the ``answer`` column where that is
    missing). None for a row with no reference."""
    out: list[float | None] = []
    for i, completion in enumerate(completions):
        ref = reasoning[i] if reasoning is not None else None
        if ref is None or (isinstance(ref, str) and not ref.strip()):
            ref = answer[i] if answer is not None else None
        if ref is None:
            out.append(None)
            continue
        hyp_text = reasoning_span(completion_text(completion))
        out.append(kg_consistency(hyp_text, reasoning_span(completion_text(ref))))
    return out
