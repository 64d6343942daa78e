"""Each reward's own advantages in a GRPO step: GDPO's aggregation, and the per-reward advantages logged.

The rewards here are the dimensions ``algorithm.multi_objective_aggregation`` speaks of: the
reward set's components with their weights (an EasyR1 reward's ``<key>/<part>`` entries are
recorded beside it, not summed, so they are no dimension), ``overlong`` with weight 1 when
DAPO's overlong shaping is on, and the KL-in-reward penalty (``kl_penalty``: the response's
summed -kl_coef * KL, weight 1) when the KL is in the reward rather than a loss term. A row no
reward of the set scored is unscored in every dimension (the trainer leaves it out of the loss).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from grouprl import algorithms
from grouprl.algorithms.multi_reward import BatchMoments
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer.metrics import StepMetrics


def reward_matrix(batch: RolloutBatch, weights: Mapping[str, float],
                  token_rewards: torch.Tensor | None) -> tuple[list[str], torch.Tensor, list[float]]:
    """(keys, scores [B, K] float64 with NaN where a reward left the row unscored, weights [K])."""
    keys, columns, out_weights = [], [], []
    for key, weight in weights.items():
        values = batch.reward_components[key]
        keys.append(key)
        columns.append([math.nan if v is None else float(v) for v in values])
        out_weights.append(float(weight))
    scores = torch.tensor(columns, dtype=torch.float64).reshape(len(keys), batch.loss_mask.shape[0]).T
    unscored = torch.isnan(scores).all(1)
    extra = []
    if "overlong" in batch.reward_components and "overlong" not in weights:
        extra.append(("overlong", torch.tensor(batch.reward_components["overlong"], dtype=torch.float64)))
    if token_rewards is not None:
        extra.append(("kl_penalty", token_rewards.detach().sum(-1).to(torch.float64).cpu()))
    for key, values in extra:
        keys.append(key)
        out_weights.append(1.0)
        scores = torch.cat([scores, torch.where(unscored, math.nan, values).unsqueeze(1)], 1)
    return keys, scores, out_weights


def reward_advantages(batch: RolloutBatch, weights: Mapping[str, float], token_rewards: torch.Tensor | None, *,
                      estimator: str, options: Mapping[str, Any], aggregation: str,
                      batch_moments_fn: BatchMoments, metrics: StepMetrics) -> torch.Tensor | None:
    """GDPO's advantages [B, R] under ``normalize_then_sum`` (None under ``sum_then_normalize``); in both,
    each reward's own advantages logged as ``advantages/<key>/mean|std|min|max`` (one value per row:
    its mean over the row's trained tokens; 0 on rows the reward left unscored).

    ``options``: the estimator's options but ``response_mask`` and ``batch_std`` (computed per reward).
    """
    keys, scores, w = reward_matrix(batch, weights, token_rewards)
    mask = batch.loss_mask
    common = dict(estimator=estimator, estimator_options=options, response_mask=mask.cpu(),
                  batch_moments_fn=batch_moments_fn)
    advantages = None
    if aggregation == "normalize_then_sum":
        advantages, per_reward = algorithms.normalize_then_sum(scores, w, batch.group_index.cpu(), **common)
        advantages = advantages.to(batch.scores.dtype)
        if advantages.dim() == 1:
            advantages = torch.where(mask.cpu() != 0, advantages.unsqueeze(-1), 0.0)
        advantages = advantages.to(mask.device)
    else:
        per_reward = algorithms.per_reward_advantages(scores, batch.group_index.cpu(), **common)
    trained = mask.cpu().to(torch.float64)
    for key, adv in zip(keys, per_reward):
        rows = adv if adv.dim() == 1 else (adv * trained).sum(-1) / trained.sum(-1).clamp(min=1)
        metrics.moments(f"advantages/{key}", rows.tolist())
        metrics.max(f"advantages/{key}/max", float(rows.max()))
        metrics.min(f"advantages/{key}/min", float(rows.min()))
    return advantages
