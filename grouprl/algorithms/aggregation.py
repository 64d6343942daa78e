"""Loss aggregation: from a per-token loss matrix L [B, R] and mask M [B, R] to one scalar.

Exact under gradient accumulation. A mini-batch is often split into micro-batches whose
losses are backpropagated one by one and summed. Means over the micro-batch would then
weight micro-batches wrongly (different token counts, different padding), so each mode
takes the mini-batch totals as options:

- ``num_tokens``: number of valid tokens (sum of M) in the whole mini-batch;
- ``num_seqs``:   number of sequences (rows, masked or not) in the whole mini-batch;
- ``norm_len``:   the constant C of ``seq-mean-token-sum-norm`` (use the configured
  maximum response length; the default, the micro-batch's padded width, changes from
  one micro-batch to the next when padding is trimmed per micro-batch).

With them, sum over micro-batches of ``aggregate_loss(L_k, M_k, mode, ...)`` equals
``aggregate_loss(L, M, mode)`` on the whole mini-batch, in value and gradient. Without
them, the micro-batch's own totals are used (correct for a single micro-batch).
A mode receives only the options it declares; the others are ignored, so a trainer can
always pass all three.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch import Tensor

from grouprl.registry import Registry

LossAggregator = Callable[..., Tensor]

LOSS_AGG_MODES: Registry[LossAggregator] = Registry("loss_agg_mode", error=ValueError)


def register_loss_agg_mode(name: str, *, overwrite: bool = False) -> Callable[[LossAggregator], LossAggregator]:
    """Decorator adding ``fn(loss_mat, mask, *, [num_tokens], [num_seqs], [norm_len]) -> Tensor``."""
    return LOSS_AGG_MODES.register(name, overwrite=overwrite)


def _nonzero(denominator: float | Tensor) -> float | Tensor:
    # An all-masked batch has a zero total; its numerator is 0 too, and 0 is the useful answer, not nan.
    if isinstance(denominator, Tensor):
        return torch.where(denominator == 0, torch.ones_like(denominator), denominator)
    return denominator if denominator != 0 else 1


def _masked(loss_mat: Tensor, mask: Tensor) -> Tensor:
    """L M where M != 0 and exactly 0 elsewhere, even where L is nan or inf.

    Selected rather than multiplied: nan * 0 and inf * 0 are nan, and the loss at padding or
    template positions is computed from log-probs nobody promised to be finite. The
    gradient there is 0 as well; callers that compute L from such inputs must still
    sanitise those inputs, since an upstream op can turn that 0 into nan (0 * nan in
    exp's backward), see ``compute_policy_loss``.
    """
    mask = mask.to(loss_mat.dtype)
    return torch.where(mask != 0, loss_mat * mask, torch.zeros_like(loss_mat))


@register_loss_agg_mode("token-mean")
def token_mean(loss_mat: Tensor, mask: Tensor, *, num_tokens: float | None = None) -> Tensor:
    """sum(L M) / N, N = ``num_tokens`` if given, else sum(M); 0 when N = 0."""
    mask = mask.to(loss_mat.dtype)
    denominator = mask.sum() if num_tokens is None else num_tokens
    return _masked(loss_mat, mask).sum() / _nonzero(denominator)


@register_loss_agg_mode("seq-mean-token-sum")
def seq_mean_token_sum(loss_mat: Tensor, mask: Tensor, *, num_seqs: float | None = None) -> Tensor:
    """sum_i sum_t (L M)_{i,t} / S, S = ``num_seqs`` if given, else B."""
    mask = mask.to(loss_mat.dtype)
    denominator = loss_mat.shape[0] if num_seqs is None else num_seqs
    return _masked(loss_mat, mask).sum() / _nonzero(denominator)


@register_loss_agg_mode("seq-mean-token-mean")
def seq_mean_token_mean(loss_mat: Tensor, mask: Tensor, *, num_seqs: float | None = None) -> Tensor:
    """sum_i [sum_t (L M)_{i,t} / sum_t M_{i,t}] / S, S = ``num_seqs`` if given, else B.

    A row whose mask is all zero (e.g. a truncated response removed by ``mask_truncated``)
    contributes 0 to the sum and still counts in S, so S is simply the number of rows.
    The recommended mode for GSPO, whose objective is a mean of per-sequence terms.
    """
    mask = mask.to(loss_mat.dtype)
    per_seq = _masked(loss_mat, mask).sum(-1) / mask.sum(-1).clamp(min=1)
    denominator = loss_mat.shape[0] if num_seqs is None else num_seqs
    return per_seq.sum() / _nonzero(denominator)


@register_loss_agg_mode("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat: Tensor, mask: Tensor, *, num_seqs: float | None = None, norm_len: float | None = None
) -> Tensor:
    """sum(L M) / (S C), S = ``num_seqs`` or B, C = ``norm_len`` or the padded width R (Dr. GRPO).

    Dividing by a constant instead of each response's length removes GRPO's length bias.
    """
    mask = mask.to(loss_mat.dtype)
    seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    length = loss_mat.shape[-1] if norm_len is None else norm_len
    return _masked(loss_mat, mask).sum() / _nonzero(seqs * length)


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float | None = None,
) -> Tensor:
    """Aggregate a per-token loss [B, R] with ``LOSS_AGG_MODES[mode]`` (formulas on each mode).

    ``num_tokens`` / ``num_seqs`` / ``norm_len`` are the mini-batch totals that make the sum of
    micro-batch values equal the whole-batch value (see the module docstring).
    Positions where the mask is 0 contribute exactly 0 to the value and the gradient, even
    when L is nan or inf there (the built-in modes select them away instead of multiplying).
    """
    fn = LOSS_AGG_MODES.get(mode, None)
    if fn is None:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid modes: {', '.join(LOSS_AGG_MODES.names())}")
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss and mask shapes differ: {tuple(loss_mat.shape)} vs {tuple(mask.shape)}")
    given = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_len": norm_len}
    declared = inspect.signature(fn).parameters
    return fn(loss_mat, mask, **{k: v for k, v in given.items() if k in declared and v is not None})
