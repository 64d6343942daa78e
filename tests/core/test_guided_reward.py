"""Guided-GRPO's reward: 0.8 accuracy + 0.1 format + 0.1 hallucination score, weights configurable."""

import pytest

from grouprl.rewards import RewardSet, RewardSpec, get_reward


def test_weights_and_terms():
    guided = get_reward("guided")
    completions = [
        "Three and two. <answer>\\boxed{5}</answer>",  # right, well formed
        "<answer>\\boxed{6}</answer>",  # wrong, well formed
        "It is 5.",  # right number, no final answer: neither accuracy nor format
        "<answer>\\boxed{5}</answer> <answer>\\boxed{5}</answer>",  # two answers: malformed, the last box right
    ]
    scores = guided(["p"] * 4, completions, answer=["5"] * 4, verifier_hallucination_score=[1.0, 0.0, 0.5, 1.0])
    # the seed grades the last \boxed{} anywhere, so a malformed answer can still be accurate
    assert scores == pytest.approx([0.8 + 0.1 + 0.1, 0.1 + 0.0, 0.05, 0.8 + 0.1])


def test_without_a_verifier_the_hallucination_term_is_the_seeds_neutral_half():
    guided = get_reward("guided")
    assert guided(["p"], ["<answer>\\boxed{\\frac{1}{2}}</answer>"], answer=["0.5"]) == pytest.approx([0.95])
    assert guided(["p"], ["x"], answer=[None], verifier_hallucination_score=[1.0]) == [None]
    with pytest.raises(ValueError, match="'answer' column"):
        guided(["p"], ["x"])


def test_weights_are_options():
    rewards = RewardSet.from_specs([RewardSpec("guided", kwargs={"accuracy_weight": 1.0, "format_weight": 0.0,
                                                                 "hallucination_weight": 0.0})])
    result = rewards.score(["p", "p"], ["<answer>\\boxed{5}</answer>", "<answer>\\boxed{4}</answer>"],
                           {"answer": ["5", "5"], "verifier_hallucination_score": [0.0, 1.0]})
    assert result.total == [1.0, 0.0]
