"""Several rewards into one advantage: sum then normalise (GRPO), or normalise each reward, then sum (GDPO).

Notation: r_ik is reward k's score of response i (NaN where reward k left row i unscored,
the ``None`` of the reward contract), w_k its weight, S_k = {i : r_ik is not NaN} the rows it
scored, S = the union of the S_k (rows with at least one scored reward), E an advantage
estimator of ``ADVANTAGE_ESTIMATORS``.

- ``sum_then_normalize`` (GRPO; TRL's default): R_i = sum_k w_k r_ik over the scored k, then
  A = E(R). This is what the trainer does with the reward set's total; nothing here.
- ``normalize_then_sum`` (GDPO, Liu et al. 2026, arXiv 2601.05242; TRL's
  ``multi_objective_aggregation="normalize_then_sum"``, verl's and NeMo-RL's ``adv_estimator:
  gdpo``): each reward is turned into advantages by the estimator on its own scored rows,
  A_k = E(r_k restricted to S_k) (0 outside S_k), summed with the weights, then renormalised
  over the batch (:func:`normalize_then_sum`). Rewards (1, 0) and (0, 1) then no longer give
  the same advantage as each other's group-mates would under their sum, and a group whose
  rows differ in two rewards is told apart from one that differs in one: the collapse of
  distinct reward combinations into identical advantages that GDPO is about.

Differences from the peers (docs/training.md says why):

- TRL 1.16 (``GRPOTrainer._generate_and_score_completions``, branch ``normalize_then_sum``)
  uses eps 1e-4 in both divisions; grouprl uses 1e-6, as its GRPO estimator does (``eps``
  sets the batch one, ``estimator_options["eps"]`` the group one). Both stds are unbiased
  (Bessel-corrected) in TRL and here. TRL hard-wires the group std (its ``scale_rewards``
  does not reach this branch); here any group estimator of the registry is used per reward
  (GRPO at every ``std_level``, RLOO, pass@k, REINFORCE++ with a group baseline). With one
  scored row in a group TRL's nanstd is NaN and the row's A_k becomes 0 (nansum), as here.
- verl 0.9.1 (``compute_gdpo_outcome_advantage``, core_algos.py) runs its GRPO estimator per
  reward (eps 1e-6, as here) and then ``masked_whiten`` over the TOKENS of the batch with
  eps 1e-8 under the square root: a long response weighs more in the batch mean and std.
  grouprl follows the paper and TRL: one value per response (row-level renormalisation).
  verl also has no unscored rows (a missing reward dimension is an error there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from grouprl.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_RELATIVE_ESTIMATORS,
    compute_advantages,
    dense_group_index,
    estimator_inputs,
)

MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")

# (values [n]) -> (mean, unbiased std, count) over the whole batch; the trainer's spans its processes
BatchMoments = Callable[[Tensor], tuple[float, float, int]]


def batch_moments(values: Tensor) -> tuple[float, float, int]:
    """(mean, std, n) of every element of ``values``, in float64.

    mean = sum_i x_i / n (0 for n = 0),
    std  = sqrt(sum_i (x_i - mean)^2 / (n - 1))   (unbiased, like torch.std; 0 for n < 2).
    One process's values; ``grouprl.trainer.parallel.batch_moments`` is the same over processes.
    """
    x = values.detach().reshape(-1).to(torch.float64)
    n = x.numel()
    mean = float(x.mean()) if n else 0.0
    return mean, float(x.std()) if n > 1 else 0.0, n


def _is_token_level(estimator: str) -> bool:
    fn = ADVANTAGE_ESTIMATORS.get(estimator, None)
    return fn is not None and "response_mask" in inspect.signature(fn).parameters


def _check_inputs(scores: Tensor, weights: Sequence[float] | Tensor | None, estimator: str) -> Tensor:
    if scores.dim() != 2:
        raise ValueError(f"scores must have shape [B, K] (one column per reward); got {tuple(scores.shape)}")
    if not scores.is_floating_point():
        raise TypeError(f"scores must be floating point (NaN marks an unscored row); got {scores.dtype}")
    if estimator not in GROUP_RELATIVE_ESTIMATORS:
        raise ValueError(f"advantage estimator {estimator!r} is not group-relative: normalising each reward needs a "
                         f"group baseline; use one of {', '.join(sorted(GROUP_RELATIVE_ESTIMATORS))}")
    k = scores.shape[1]
    w = torch.ones(k, dtype=torch.float64) if weights is None else torch.as_tensor(weights, dtype=torch.float64)
    if w.shape != (k,):
        raise ValueError(f"weights must have one entry per reward ({k}); got shape {tuple(w.shape)}")
    return w.to(scores.device)


def per_reward_advantages(
    scores: Tensor,
    group_index: Any,
    *,
    estimator: str = "grpo",
    estimator_options: Mapping[str, Any] | None = None,
    response_mask: Tensor | None = None,
    batch_moments_fn: BatchMoments | None = None,
) -> Tensor:
    """Each reward's own advantages, unweighted: [K, B], or [K, B, R] for a token-level estimator.

    A_k[i] = E(r_k[S_k], g[S_k], **estimator_options)[i]  for i in S_k,  0 otherwise,
    so a group's statistics for reward k are over the rows reward k scored (TRL's nanmean /
    nanstd), and a row reward k left unscored neither moves them nor gets an A_k.

    ``scores`` [B, K] with NaN for unscored; ``group_index`` any ids ``dense_group_index``
    accepts. ``response_mask`` [B, R] is handed to token-level estimators (required by them,
    e.g. ``reinforce_plus_plus_baseline``) and ignored by outcome ones. For ``grpo`` with
    ``std_level="batch"`` each reward's batch std is that of its own scored values over the
    whole batch, ``batch_moments_fn(r_k[S_k])`` (default: these rows, :func:`batch_moments`),
    taken as 1 below two rows like the estimator's own. Computed in float64 where the
    estimators do, returned in the scores' dtype.
    """
    _check_inputs(scores, None, estimator)
    options = dict(estimator_options or {})
    if "batch_std" in options or "response_mask" in options:
        raise TypeError("estimator_options: batch_std is computed per reward (pass batch_moments_fn) and "
                        "response_mask is its own argument")
    moments = batch_moments_fn or batch_moments
    takes_batch_std = "batch_std" in estimator_inputs(estimator, options)
    token_level = _is_token_level(estimator)
    if token_level and response_mask is None:
        raise ValueError(f"advantage estimator {estimator!r} is token-level and needs response_mask")
    dense = dense_group_index(group_index, scores.shape[0], device=scores.device)
    shape = (scores.shape[0], response_mask.shape[-1]) if token_level else (scores.shape[0],)
    out = torch.zeros((scores.shape[1], *shape), dtype=scores.dtype, device=scores.device)
    for k in range(scores.shape[1]):
        rows = ~torch.isnan(scores[:, k])
        values = scores[rows, k]
        opts = dict(options)
        if takes_batch_std:  # the estimator needs it under these options (grpo: std_level batch)
            _, std, n = moments(values)
            opts["batch_std"] = std if n > 1 else 1.0
        # every process calls batch_moments_fn for every reward, rows or none: it may be a collective
        if not bool(rows.any()):
            continue
        if token_level:
            opts["response_mask"] = response_mask[rows]
        out[k, rows] = compute_advantages(estimator, values, dense[rows], **opts).to(scores.dtype)
    return out


def normalize_then_sum(
    scores: Tensor,
    weights: Sequence[float] | Tensor | None,
    group_index: Any,
    *,
    estimator: str = "grpo",
    estimator_options: Mapping[str, Any] | None = None,
    response_mask: Tensor | None = None,
    eps: float = 1e-6,
    batch_moments_fn: BatchMoments | None = None,
) -> tuple[Tensor, Tensor]:
    """GDPO's advantages and the per-reward ones: (A' [B] or [B, R], A_k [K, B] or [K, B, R]).

    A_k  = per-reward advantages (:func:`per_reward_advantages`: E on reward k's scored rows, 0 elsewhere)
    A_i  = sum_k w_k A_k[i]
    a_i  = A_i  (outcome estimators)  or  sum_t A_it m_it / sum_t m_it  (token-level; 0 for no token)
    mu, sigma = mean and unbiased std of a_i over i in S (rows with at least one scored reward),
                ``batch_moments_fn(a[S])`` (default: these rows, :func:`batch_moments`; sigma = 0 below two rows)
    A'_i = (A_i - mu) / (sigma + eps)  for i in S,   0 for a row no reward scored.

    The renormalisation is over responses, one value each (the paper's and TRL's), not over
    tokens (verl's ``masked_whiten``); see the module docstring for eps and the peers.
    ``weights`` [K] (None: all 1). Outcome estimators give A' [B] (broadcast it with the
    response mask as ``compute_advantages`` does); a token-level one gives [B, R], exactly 0 on
    masked tokens. ValueError for an estimator that is not group-relative (REINFORCE++ and
    ReMax have no group baseline to normalise a reward within).
    """
    w = _check_inputs(scores, weights, estimator)
    per_reward = per_reward_advantages(scores, group_index, estimator=estimator, estimator_options=estimator_options,
                                       response_mask=response_mask, batch_moments_fn=batch_moments_fn)
    x = per_reward.to(torch.float64)
    total = (w.reshape(-1, *([1] * (x.dim() - 1))) * x).sum(0)
    scored = ~torch.isnan(scores).all(1)
    if total.dim() == 2:
        valid = response_mask != 0
        row_value = torch.where(valid, total, 0.0).sum(-1) / valid.sum(-1).clamp(min=1)
    else:
        row_value = total
    mean, std, _ = (batch_moments_fn or batch_moments)(row_value[scored])
    out = (total - mean) / (std + eps)
    keep = scored.unsqueeze(-1) & (response_mask != 0) if total.dim() == 2 else scored
    return torch.where(keep, out, 0.0).to(scores.dtype), per_reward
