"""Off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, eq. 9): drop the negative-advantage
responses that the policy being trained has drifted far from.

A response with a negative advantage pushes probability away from its tokens. When the policy
now trained already gives those tokens much less probability than the sampler did (a stale
batch, another engine's numerics), that push is mostly noise from off-policy data and can
destabilise training; the response is left out of the policy loss.
"""

from __future__ import annotations

import torch
from torch import Tensor


def off_policy_sequence_mask(
    advantages: Tensor,
    log_prob: Tensor,
    sampler_log_prob: Tensor,
    response_mask: Tensor,
    *,
    delta: float,
) -> Tensor:
    """M [B, R] in {0, 1}: the token weights of off-policy sequence masking.

    kl_i = sum_t m_t (log pi_sampler(o_t) - sg(log pi_theta(o_t))) / max(sum_t m_t, 1)
    M_{i,t} = 0 if A_{i,t} < 0 and kl_i > delta, else 1;  M_{i,t} = 0 where m_t = 0

    pi_theta is the policy being trained (detached: the mask carries no gradient), pi_sampler
    the one that sampled (the engine's log-probs, or the old policy's). A nan sampler log-prob
    (a token the engine could not score) counts as 0 divergence but still in the length, as
    TRL's ``GRPOTrainer.get_off_policy_mask`` does, so one unscored token cannot drop a
    response. Log-probs at masked positions (padding, template tokens) are never read.
    A_{i,t} is per token as in the paper; with one advantage per response the whole response
    is kept or dropped. Multiply the per-token policy loss by M (``compute_policy_loss(...,
    token_weights=M)``).
    """
    if not (delta > 0 and delta != float("inf")):
        raise ValueError(f"off-policy sequence masking needs delta > 0 and finite; got {delta}")
    inputs = (advantages, log_prob, sampler_log_prob, response_mask)
    if len({t.shape for t in inputs}) != 1 or log_prob.dim() != 2:
        raise ValueError("advantages, log_prob, sampler_log_prob and response_mask must share one [B, R] shape; got "
                         + ", ".join(str(tuple(t.shape)) for t in inputs))
    valid = response_mask != 0
    divergence = torch.nan_to_num(sampler_log_prob - log_prob.detach(), nan=0.0)
    divergence = torch.where(valid, divergence, torch.zeros_like(divergence))
    seq_divergence = divergence.sum(-1, keepdim=True) / valid.sum(-1, keepdim=True).clamp(min=1)
    drop = (advantages < 0) & (seq_divergence > delta)
    return (valid & ~drop).to(log_prob.dtype)
