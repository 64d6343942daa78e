"""Choosing which responses train: group filtering (DAPO dynamic sampling), overlong shaping, truncation masks."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.algorithms.advantages import dense_group_index, group_statistics


def reward_std_per_group(scores: Tensor, group_index: Any) -> Tensor:
    """std_g of each row's group, shape [B]: unbiased, and 0 for a group of size 1.

    ``(reward_std_per_group(...) == 0).float().mean()`` is the ``frac_reward_zero_std``
    health metric: the share of responses whose group gives GRPO no learning signal.
    Computed in float64 (see ``group_statistics``), so a group of equal scores has std
    exactly 0 even when float32 rounding makes its float32 mean differ from the scores.
    Group ids: any kind ``dense_group_index`` accepts (tensor, list, numpy array, strings).
    """
    return group_statistics(scores, group_index)[1]


def filter_groups(scores: Tensor, group_index: Any, *, min_std: float = 0.0) -> Tensor:
    """Rows to keep, BoolTensor [B]: keep_i = std_g(i) > ``min_std``.

    ``min_std=0`` drops groups whose rewards are all equal (DAPO dynamic sampling: their
    group-relative advantages are all 0); CheXPO-v2 uses 0.06. A group of size 1 has
    std 0 and is always dropped. std_g is compared in float64, so neither a float32
    rounding residue nor float32 rounding of a std near ``min_std`` decides the outcome.
    """
    return group_statistics(scores, group_index, dtype=torch.float64)[1] > min_std


def filter_groups_by_mean(values: Tensor, group_index: Any, *, low: float, high: float) -> Tensor:
    """Rows to keep, BoolTensor [B]: keep_i = ``low`` < m_g(i) < ``high`` (EasyR1's online filtering).

    m_g = sum_{j in g, v_j defined} v_j / #{j in g : v_j defined}: the mean of group g's values,
    NaN marking a row the value does not apply to; a group with no defined value has no mean
    and is dropped. Both bounds are strict, as in EasyR1, whose defaults (0.01, 0.99) drop the
    groups of a {0, 1} reward that are all wrong or all right. ``values`` is any per-row
    quantity (the overall reward, one component, one part of an EasyR1 score); computed in
    float64. Group ids: any kind ``dense_group_index`` accepts.
    """
    if not low < high:
        raise ValueError(f"need low < high; got low={low}, high={high}")
    v = values.detach().to(torch.float64)
    dense = dense_group_index(group_index, v.shape[0], device=v.device)
    if not v.numel():
        return torch.zeros(0, dtype=torch.bool, device=v.device)
    defined = ~torch.isnan(v)
    groups = int(dense.max()) + 1
    sums = torch.zeros(groups, dtype=torch.float64, device=v.device).index_add_(0, dense, torch.where(defined, v, 0.0))
    counts = torch.zeros(groups, dtype=torch.float64, device=v.device).index_add_(0, dense, defined.to(torch.float64))
    mean = (sums / counts)[dense]  # NaN for a group with no defined value: both comparisons are False
    return (mean > low) & (mean < high)


def overlong_penalty(
    response_lengths: Tensor, *, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment, shape [B], added to the reward.

    with L_max = ``max_length``, L_buf = ``buffer_length``, f = ``penalty_factor``:
      0                              if L <= L_max - L_buf
      (L_max - L_buf - L) / L_buf * f  if L_max - L_buf < L <= L_max
      -f                             if L > L_max
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"need 0 < buffer_length <= max_length; got buffer_length={buffer_length}, max_length={max_length}"
        )
    lengths = response_lengths.to(torch.get_default_dtype())
    start = max_length - buffer_length
    # The linear ramp reaches -1 at L_max, so clamping at -1 covers the L > L_max case.
    ramp = ((start - lengths) / buffer_length).clamp(min=-1.0, max=0.0)
    return ramp * penalty_factor


def mask_truncated(loss_mask: Tensor, truncated: Tensor) -> Tensor:
    """Loss mask with the rows of truncated responses zeroed: M'_{i,t} = M_{i,t} * (1 - truncated_i).

    A truncated response (no EOS) was cut, not finished, so its reward judges text the
    policy did not complete; TRL's ``mask_truncated_completions``.
    """
    if truncated.shape != loss_mask.shape[:1]:
        raise ValueError(f"truncated must have shape [{loss_mask.shape[0]}]; got {tuple(truncated.shape)}")
    keep = (~truncated.bool()).unsqueeze(-1)
    return loss_mask * keep.to(loss_mask.dtype) if loss_mask.dtype != torch.bool else loss_mask & keep
