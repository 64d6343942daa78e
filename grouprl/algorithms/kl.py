"""Per-token estimators of KL(pi_theta || pi_ref) from sampled tokens' log-probabilities.

delta = log pi_theta(y_t) - log pi_ref(y_t), with y_t sampled from the policy. Used either
as a loss term (mean over tokens, times kl_coef) or folded into the reward as
token_rewards = -beta * kl_penalty(...).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from grouprl.registry import Registry

KLEstimator = Callable[[Tensor, Tensor], Tensor]

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", error=ValueError)


def register_kl_estimator(*names: str, overwrite: bool = False) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator adding ``fn(log_prob, ref_log_prob) -> Tensor`` to ``KL_ESTIMATORS`` under each name (aliases)."""

    def decorator(fn: KLEstimator) -> KLEstimator:
        for name in names:
            KL_ESTIMATORS.register(name, fn, overwrite=overwrite)
        return fn

    return decorator


@register_kl_estimator("k1", "kl")
def kl_k1(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k1 = delta. Unbiased, high variance, can be negative per token."""
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """|delta|."""
    return (log_prob - ref_log_prob).abs()


@register_kl_estimator("k2", "mse")
def kl_k2(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k2 = 0.5 delta^2. Biased, lower variance than k1, never negative."""
    return 0.5 * (log_prob - ref_log_prob) ** 2


@register_kl_estimator("k3", "low_var_kl")
def kl_k3(log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """k3 = exp(-delta) + delta - 1 >= 0, with -delta clamped to [-20, 20] and the result to [-10, 10].

    Unbiased and low variance; the clamps keep one token with a huge log-ratio from
    producing inf (exp overflow) or dominating the loss.
    """
    neg_delta = (ref_log_prob - log_prob).clamp(-20.0, 20.0)
    return (torch.exp(neg_delta) - neg_delta - 1).clamp(-10.0, 10.0)


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str, *, response_mask: Tensor | None = None) -> Tensor:
    """Per-token KL estimate ``KL_ESTIMATORS[kind](log_prob, ref_log_prob)``, same shape as the inputs.

    With ``response_mask``: KL_t where m_t != 0, exactly 0 where m_t = 0, and the log-probs at
    masked positions are never read. They are replaced by 0 before the estimator runs, so a
    nan or inf there (padding, template tokens) reaches neither the value nor the gradient;
    masking the result afterwards would not save the gradient (k3's exp backward: 0 * nan).
    """
    estimator = KL_ESTIMATORS.get(kind, None)
    if estimator is None:
        raise ValueError(f"unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_ESTIMATORS.names())}")
    if response_mask is None:
        return estimator(log_prob, ref_log_prob)
    if response_mask.shape != log_prob.shape:
        raise ValueError(f"response_mask must have shape {tuple(log_prob.shape)}; got {tuple(response_mask.shape)}")
    valid = response_mask != 0
    kl = estimator(torch.where(valid, log_prob, 0.0), torch.where(valid, ref_log_prob, 0.0))
    return torch.where(valid, kl, 0.0)


def unbiased_kl_penalty(
    log_prob: Tensor, ref_log_prob: Tensor, old_log_prob: Tensor, kind: str = "k3", *,
    response_mask: Tensor | None = None,
) -> Tensor:
    """DeepSeek-V3.2's unbiased KL estimate (arXiv 2512.02556): the per-token estimate times the
    importance ratio of the policy being trained to the one that sampled.

    KL_t = r_t * KL_ESTIMATORS[kind](log_prob, ref_log_prob)_t,  r_t = exp(clamp(log_prob - old_log_prob, -20, 20))
    The tokens were sampled from pi_old, so E_old[r k] = E_theta[k]: with r_t differentiable the
    gradient is an unbiased estimate of the reverse KL's gradient, even on-policy (old = sg(log_prob),
    where r_t = 1 in value but not in gradient). DeepSeek's and TRL's (``use_bias_correction_kl``)
    estimator is k3, unclipped; grouprl's k3 clips to [-10, 10] and d to [-20, 20], and r_t is
    always per token (TRL's follows ``importance_sampling_level``). Masked positions as in
    ``kl_penalty``: exactly 0 with ``response_mask``, never read.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind, response_mask=response_mask)
    if response_mask is not None:  # a nan there would reach the gradient through exp's backward
        valid = response_mask != 0
        log_prob, old_log_prob = torch.where(valid, log_prob, 0.0), torch.where(valid, old_log_prob, 0.0)
    log_ratio = log_prob - old_log_prob
    return kl * torch.exp(log_ratio.clamp(-20.0, 20.0))
