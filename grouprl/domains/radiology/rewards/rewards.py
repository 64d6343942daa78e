"""Clinical report scores as TRL-contract reward functions.

    worker.reward.functions: [{name: editgrpo_composite}]
    worker.reward.functions: [{name: clinical, kwargs: {components: [radgraphf1, ratescore], type: free_form}}]

Each reward compares a completion with the reference report in the ``answer``
column through the named components of ``components.py``. ``type`` applies
EditGRPO's response formats (``short`` needs ``\\boxed{}``, ``cot`` needs
``<think>...</think>`` then ``\\boxed{}``): in process a completion without the
required format scores 0. (EditGRPO's reward server, and ``grouprl serve rewards``
with it, instead drop only their format term and still score the content; these
in-process sums have no format term, so they refuse the content instead.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grouprl.domains.radiology.rewards.components import get_component, score_components
from grouprl.rewards.contract import completion_text
from grouprl.rewards.registry import register_reward

EDITGRPO_COMPONENTS = ("radgraphf1", "cxb14micro", "ratescore")


def score_reports(completions: Sequence[Any], answer: Sequence[str | None] | None, components: Sequence[str],
                  response_type: str = "free_form") -> list[float | None]:
    """Sum of the named components per row; None where a row has no reference report."""
    from grouprl.domains.radiology.rewards.answers import extract_report

    if answer is None:
        raise ValueError("clinical rewards need the reference report in the 'answer' column")
    for name in components:
        get_component(name)  # unknown names fail before any scoring
    rows, hyps, refs = [], [], []
    for i, (completion, ref) in enumerate(zip(completions, answer)):
        if ref is None:
            continue
        report = extract_report(completion_text(completion), response_type)
        rows.append((i, report is not None))
        hyps.append(report or "")
        refs.append(str(ref))
    out: list[float | None] = [None] * len(completions)
    if not hyps:
        return out
    scores = score_components(hyps, refs, list(components))
    for j, (i, formatted) in enumerate(rows):
        out[i] = sum(scores[name][j] for name in components) if formatted else 0.0
    return out


@register_reward("clinical")
def clinical_reward(prompts, completions, *, answer=None, components: Sequence[str] = EDITGRPO_COMPONENTS,
                    type: str = "free_form", **kwargs) -> list[float | None]:
    """Sum of the chosen report score components (EditGRPO's composite by default)."""
    return score_reports(completions, answer, list(components), type)


@register_reward("editgrpo_composite")
def editgrpo_composite_reward(prompts, completions, *, answer=None, type: str = "free_form",
                              **kwargs) -> list[float | None]:
    """EditGRPO's reward: RadGraph partial F1 + CheXpert-label micro F1 (14) + RaTEScore, in [0, 3]."""
    return score_reports(completions, answer, EDITGRPO_COMPONENTS, type)


@register_reward("radgraphf1")
def radgraph_f1_reward(prompts, completions, *, answer=None, type: str = "free_form", **kwargs) -> list[float | None]:
    """RadGraph-style partial F1 against the reference report."""
    return score_reports(completions, answer, ["radgraphf1"], type)


@register_reward("cxb14micro")
def chexpert_micro_reward(prompts, completions, *, answer=None, type: str = "free_form", **kwargs) -> list[float | None]:
    """Per-sample micro F1 of the 14 CheXpert-style labels against the reference report."""
    return score_reports(completions, answer, ["cxb14micro"], type)


@register_reward("ratescore")
def ratescore_reward(prompts, completions, *, answer=None, type: str = "free_form", **kwargs) -> list[float | None]:
    """RaTEScore-style entity-aware similarity to the reference report."""
    return score_reports(completions, answer, ["ratescore"], type)
