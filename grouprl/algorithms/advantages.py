"""Advantage estimators: from one scalar score per response to per-response (or per-token) advantages.

Notation: a group is the set of responses that answer the same prompt (rows sharing
a ``group_index`` id); R_i is response i's score; n_g, mean_g, std_g are its group's
size, mean and unbiased standard deviation; m is the response mask.

Every estimator is a pure function ``fn(scores, group_index, *, <options>)`` registered
by name in ``ADVANTAGE_ESTIMATORS``. Outcome estimators return one advantage per
response, shape [B]; ``compute_advantages`` broadcasts it to the tokens when a
``response_mask`` is given. Token-level estimators declare a ``response_mask``
parameter and return [B, R] themselves.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import Tensor

AdvantageEstimator = Callable[..., Tensor]

ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str, *, overwrite: bool = False
) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator adding ``fn(scores, group_index, *, **options) -> Tensor`` to ``ADVANTAGE_ESTIMATORS``.

    Declare a keyword parameter ``response_mask`` to receive the [B, R] mask and return
    per-token advantages; otherwise return one advantage per row ([B]).
    """

    def decorator(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS and not overwrite:
            raise ValueError(f"advantage estimator {name!r} is already registered (pass overwrite=True to replace it)")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return decorator


# ---------------------------------------------------------------------------
# Group statistics
# ---------------------------------------------------------------------------


def group_statistics(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row statistics of the row's group: (mean_g, std_g, n_g), each shape [B].

    mean_g = sum_{j in g} R_j / n_g
    std_g  = sqrt(sum_{j in g} (R_j - mean_g)^2 / (n_g - 1))   (unbiased, like torch.std)
             and 0 for a group of size 1 (where the unbiased estimate is undefined).
    Group ids may be any integers; they need not be contiguous or sorted.
    """
    if scores.dim() != 1 or group_index.shape != scores.shape:
        raise ValueError(
            f"scores and group_index must both have shape [B]; got {tuple(scores.shape)} and {tuple(group_index.shape)}"
        )
    _, dense = torch.unique(group_index, return_inverse=True)
    num_groups = int(dense.max()) + 1 if dense.numel() else 0
    def per_group_sum(values: Tensor) -> Tensor:
        return torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, dense, values)

    count = per_group_sum(torch.ones_like(scores))
    mean = per_group_sum(scores) / count
    # Two-pass variance: subtracting the mean first avoids the cancellation of E[x^2] - E[x]^2.
    sum_squared = per_group_sum((scores - mean[dense]) ** 2)
    std = torch.where(count > 1, (sum_squared / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
    return mean[dense], std[dense], count[dense]


def _as_float(scores: Tensor) -> Tensor:
    return scores if scores.is_floating_point() else scores.to(torch.get_default_dtype())


def _check_token_shape(name: str, tensor: Tensor, scores: Tensor) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != scores.shape[0]:
        raise ValueError(f"{name} must have shape [B, R] with B={scores.shape[0]}; got {tuple(tensor.shape)}")


def masked_whiten(values: Tensor, mask: Tensor, eps: float) -> Tensor:
    """Whiten ``values`` over the positions where ``mask`` is 1, zero elsewhere.

    out = (x - mu) / (sigma + eps) * m,  mu = sum(x m)/sum(m),
    sigma = sqrt(sum((x - mu)^2 m) / (sum(m) - 1))   (unbiased; 0 when sum(m) < 2).
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1)
    centred = (values - mean) * mask
    var = (centred**2).sum() / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
    return centred / (std + eps)


# ---------------------------------------------------------------------------
# Outcome estimators: one advantage per response
# ---------------------------------------------------------------------------


@register_advantage_estimator("grpo")
def grpo_advantages(scores: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (R_i - mean_g) / (std_g + eps); with ``norm_by_std=False`` (Dr. GRPO) A_i = R_i - mean_g.

    A group of size 1 gets A_i = 0: its mean is its own score and its std is taken as 1
    (so that 0 stays 0 even with eps = 0).
    Dr. GRPO pairs ``norm_by_std=False`` with loss_agg_mode ``seq-mean-token-sum-norm``.
    """
    scores = _as_float(scores)
    mean, std, count = group_statistics(scores, group_index)
    centred = scores - mean
    if not norm_by_std:
        return centred
    return centred / (torch.where(count > 1, std, torch.ones_like(std)) + eps)


@register_advantage_estimator("rloo")
def rloo_advantages(scores: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: A_i = R_i - sum_{j in g, j != i} R_j / (n_g - 1) = n_g / (n_g - 1) * (R_i - mean_g).

    A group of size 1 has no other responses to compare with and gets A_i = 0.
    """
    scores = _as_float(scores)
    mean, _, count = group_statistics(scores, group_index)
    scale = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.zeros_like(count))
    return scale * (scores - mean)


@register_advantage_estimator("remax")
def remax_advantages(scores: Tensor, group_index: Tensor, *, baseline_scores: Tensor) -> Tensor:
    """ReMax: A_i = R_i - b_i, b_i = reward of the greedy response to row i's prompt (``baseline_scores`` [B]).

    ``group_index`` is not needed by the formula; it is accepted to keep one estimator signature.
    """
    scores = _as_float(scores)
    if baseline_scores.shape != scores.shape:
        raise ValueError(f"baseline_scores must have shape {tuple(scores.shape)}; got {tuple(baseline_scores.shape)}")
    return scores - baseline_scores.to(scores.dtype)


@register_advantage_estimator("grpo_passk")
def grpo_passk_advantages(
    scores: Tensor, group_index: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Pass@k GRPO: only the best response of each group is credited.

    A_best = (R_max - R_second) / (std_g + eps)  (or R_max - R_second with ``norm_by_std=False``),
    every other response A_i = 0. Ties for the best go to the lowest row index, and then
    R_max - R_second = 0. A group of size 1 has no second response and gets 0.
    """
    scores = _as_float(scores)
    _, std, _ = group_statistics(scores, group_index)
    _, dense = torch.unique(group_index, return_inverse=True)
    # Sort by score descending, then (stably) by group: each group becomes a contiguous
    # run ordered best-first, with ties kept in row order.
    by_score = torch.argsort(scores, descending=True, stable=True)
    order = by_score[torch.argsort(dense[by_score], stable=True)]
    sizes = torch.bincount(dense)
    starts = torch.cumsum(sizes, 0) - sizes
    has_second = sizes > 1
    best_rows = order[starts[has_second]]
    second_rows = order[starts[has_second] + 1]
    gap = scores[best_rows] - scores[second_rows]
    if norm_by_std:
        gap = gap / (std[best_rows] + eps)
    advantages = torch.zeros_like(scores)
    advantages[best_rows] = gap
    return advantages


# ---------------------------------------------------------------------------
# Token-level estimators: return [B, R]
# ---------------------------------------------------------------------------


@register_advantage_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    scores: Tensor,
    group_index: Tensor,
    *,
    response_mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    eps: float = 1e-6,
) -> Tensor:
    """REINFORCE++: whitened discounted token returns.

    r_t = token_rewards_t + [t = last valid token] * R_i        (masked tokens carry no reward)
    G_t = sum_{k >= t} gamma^(k - t) r_k
    A_t = whiten(G) over all valid tokens of the batch (see ``masked_whiten``).
    KL-in-reward enters as ``token_rewards = -beta * kl_penalty(...)``.
    ``group_index`` is not used: the baseline is the batch mean, not the group mean.
    """
    scores = _as_float(scores)
    _check_token_shape("response_mask", response_mask, scores)
    mask = response_mask.to(scores.dtype)
    rewards = torch.zeros_like(mask)
    if token_rewards is not None:
        _check_token_shape("token_rewards", token_rewards, scores)
        rewards = rewards + token_rewards.to(scores.dtype)
    rewards = rewards * mask
    lengths = response_mask.to(torch.long).sum(-1)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    # Last valid token by position, so masks with holes (e.g. edited spans) still work.
    last = torch.where(response_mask.bool(), positions, torch.full_like(positions, -1)).amax(-1)
    rows = torch.nonzero(lengths > 0, as_tuple=True)[0]
    rewards[rows, last[rows]] += scores[rows]

    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(scores)
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return masked_whiten(returns, mask, eps)


@register_advantage_estimator("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, group_index: Tensor, *, response_mask: Tensor, eps: float = 1e-6
) -> Tensor:
    """REINFORCE++ with a group baseline.

    a_i = R_i - mean_g, broadcast to every valid token of response i,
    A_t = whiten(a) over all valid tokens of the batch (see ``masked_whiten``),
    so long responses weigh more in the batch statistics, as in token-level whitening.
    """
    scores = _as_float(scores)
    _check_token_shape("response_mask", response_mask, scores)
    mean, _, _ = group_statistics(scores, group_index)
    mask = response_mask.to(scores.dtype)
    return masked_whiten((scores - mean).unsqueeze(-1) * mask, mask, eps)


# ---------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------


def compute_advantages(name: str, scores: Tensor, group_index: Tensor, **options) -> Tensor:
    """Advantages by estimator name: ``ADVANTAGE_ESTIMATORS[name](scores, group_index, **options)``.

    Returns [B, R] (zero on masked tokens) when ``response_mask`` [B, R] is given, else [B].
    Outcome advantages are broadcast as A_{i,t} = A_i * m_{i,t}. Token-level estimators
    (``reinforce_plus_plus*``) require ``response_mask``.
    Raises ValueError for an unknown name or a missing required option, and TypeError
    for an option the estimator does not take.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        valid_names = ", ".join(sorted(ADVANTAGE_ESTIMATORS))
        raise ValueError(f"unknown advantage estimator {name!r}; valid names: {valid_names}")
    fn = ADVANTAGE_ESTIMATORS[name]
    params = dict(inspect.signature(fn).parameters)
    accepted = {p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY}
    # Token-level estimators take the mask themselves; for outcome ones it is only for broadcasting.
    token_level = "response_mask" in accepted
    response_mask = None if token_level else options.pop("response_mask", None)
    unknown = sorted(set(options) - accepted)
    if unknown:
        valid = ", ".join(sorted(accepted | {"response_mask"})) or "none"
        raise TypeError(
            f"advantage estimator {name!r} got unknown option(s) {', '.join(unknown)}; valid options: {valid}"
        )
    missing = sorted(p for p in accepted if params[p].default is inspect.Parameter.empty and options.get(p) is None)
    if missing:
        raise ValueError(f"advantage estimator {name!r} needs option(s): {', '.join(missing)}")

    advantages = fn(scores, group_index, **options)
    if token_level:
        return advantages * options["response_mask"].to(advantages.dtype)
    if response_mask is None:
        return advantages
    _check_token_shape("response_mask", response_mask, advantages)
    return advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
