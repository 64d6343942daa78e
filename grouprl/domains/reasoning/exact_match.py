"""The validation metric ``exact_match``: the guided demo's single-turn accuracy on held-out problems.

A response is right when its final answer (the boxed content of its ``<answer>`` span,
:func:`grouprl.rewards.rule_based.final_answer`) matches the reference's answer
(:func:`~grouprl.rewards.rule_based.extract_answer`) as normalised text, as an exact number, or
by math-verify's equivalence (:func:`~grouprl.rewards.rule_based.answers_match`): the demo's
``evaluate_arithmetic`` ``accuracy``. Keys, over every response (val_n per prompt):

- ``accuracy`` = (responses right) / (responses);
- ``format_rate`` = (responses with a final answer) / (responses).
"""

from __future__ import annotations

from collections.abc import Sequence


def answer_right(response: str, reference: str) -> bool:
    """Whether ``response``'s final answer matches ``reference``'s answer (see the module docstring)."""
    from grouprl.rewards.rule_based import answers_match, extract_answer, final_answer

    got = final_answer(response)
    return got is not None and answers_match(extract_answer(reference), got)


def exact_match(completions: Sequence[str], references: Sequence[str], **columns) -> dict[str, float]:
    """``accuracy`` and ``format_rate`` of ``completions`` against ``references`` (see the module docstring)."""
    from grouprl.rewards.rule_based import final_answer

    if not completions:
        raise ValueError("no responses to score")
    missing = [i for i, r in enumerate(references) if not isinstance(r, str)]
    if missing:
        raise ValueError(f"row {missing[0]} has no reference answer ({len(missing)} rows without one)")
    right = sum(answer_right(c, r) for c, r in zip(completions, references))
    formatted = sum(final_answer(c) is not None for c in completions)
    return {"accuracy": right / len(completions), "format_rate": formatted / len(completions)}
