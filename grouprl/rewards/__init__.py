"""Rewards: the reward-function contract, the registry, and the built-in rule-based rewards.

A reward is ``f(prompts, completions, **columns) -> list[float | None]`` (TRL's
contract; ``async def`` allowed, ``None`` = not applicable). Reference one by
registered name or ``path/to/file.py:function``, combine several with weights::

    rewards = RewardSet.from_specs([RewardSpec("format", 0.2), RewardSpec("accuracy")])
    result = rewards.score(prompts, completions, {"answer": answers})
    result.total, result.components, result.metrics()

This layer imports no torch, model or trainer code, and no domain code: the clinical
rewards (``editgrpo_composite``, ``kg_consistency``, ``finding_f1``, ...) come from
plugins (``grouprl.plugins`` entry points) that the registry imports the first time
one of their names is asked for.
"""

from grouprl.rewards.contract import (
    RewardComponent,
    RewardError,
    RewardResult,
    RewardSet,
    RewardSpec,
)
from grouprl.rewards.registry import (
    RewardLoadError,
    get_reward,
    load_plugins,
    register_reward,
    registered_rewards,
)

# Imported for its side effect too: registering the built-in names.
from grouprl.rewards.rule_based import (
    accuracy_reward,
    extract_answer,
    extract_boxed,
    format_reward,
    length_reward,
    math_equal,
    normalize_answer,
)

__all__ = [
    "RewardComponent",
    "RewardError",
    "RewardLoadError",
    "RewardResult",
    "RewardSet",
    "RewardSpec",
    "accuracy_reward",
    "extract_answer",
    "extract_boxed",
    "format_reward",
    "get_reward",
    "length_reward",
    "load_plugins",
    "math_equal",
    "normalize_answer",
    "register_reward",
    "registered_rewards",
]
