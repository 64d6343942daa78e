"""Rewards: the two reward-function contracts, their registries, scoring, and the built-in rule-based rewards.

A text reward is ``f(prompts, completions, **columns) -> list[float | None]`` (TRL's
contract), an image reward ``f(images, prompts, **metadata) -> list[float | None]``;
``async def`` allowed, ``None`` = not applicable. Reference one by registered name or
``path/to/file.py:function``, combine several with weights; one scoring implementation
serves both (:mod:`grouprl.rewards.scoring`)::

    rewards = RewardSet.from_specs([RewardSpec("format", 0.2), RewardSpec("accuracy")])
    result = rewards.score(prompts, completions, {"answer": answers})
    result.total, result.components, result.metrics()

    result = ImageRewardSet.from_specs(["ocr"]).score(images, prompts, {"text": targets})

This layer imports no torch, model or trainer code, and no domain code: the clinical
rewards (``editgrpo_composite``, ``kg_consistency``, ``finding_f1``, ...) and the image
rewards (``ocr``, ``vlm_judge``, ...) come from plugins (``grouprl.plugins`` entry
points) that the registries import the first time one of their names is asked for.
"""

from grouprl.rewards.contract import (
    IMAGE,
    TEXT,
    ImageRewardSpec,
    RewardComponent,
    RewardContract,
    RewardError,
    RewardTimeout,
    RewardResult,
    RewardSpec,
    UnscoredError,
    weighted_total,
)
from grouprl.rewards.registry import (
    IMAGE_REWARDS,
    REWARDS,
    RewardLoadError,
    get_reward,
    load_plugins,
    register_image_reward,
    register_reward,
    registered_rewards,
)
from grouprl.rewards.scoring import ImageRewardSet, RewardSet

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
    "IMAGE",
    "IMAGE_REWARDS",
    "REWARDS",
    "TEXT",
    "ImageRewardSet",
    "ImageRewardSpec",
    "RewardComponent",
    "RewardContract",
    "RewardError",
    "RewardTimeout",
    "RewardLoadError",
    "RewardResult",
    "RewardSet",
    "RewardSpec",
    "UnscoredError",
    "accuracy_reward",
    "extract_answer",
    "extract_boxed",
    "format_reward",
    "get_reward",
    "length_reward",
    "load_plugins",
    "math_equal",
    "normalize_answer",
    "register_image_reward",
    "register_reward",
    "registered_rewards",
    "weighted_total",
]
