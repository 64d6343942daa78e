"""Entropy regularisation: the entropy bonus of the loss and its adaptive coefficient (Skywork-OR1, TRL).

The loss with the bonus is ``L = L_policy (+ kl_coef * L_kl) - c * H``, where ``H`` is the
mean per-token entropy of the policy over the loss mask (:func:`entropy_bonus`) and ``c`` the
coefficient: fixed, or (adaptive) moved towards a target entropy once per optimizer step
(:func:`adaptive_entropy_coef`) and applied only while the entropy is at or below the target
(:func:`applied_entropy_coef`). As in TRL's ``GRPOTrainer`` (1.16, ``compute_loss``), the bonus
is a token mean whatever ``loss_agg_mode`` the policy loss uses, so ``c`` means the same for
every mode.

Where grouprl differs from TRL: TRL divides each micro-batch's entropy sum by that micro-batch's
own token count and then by the number of accumulation steps, so its bonus depends on how the
tokens fall into micro-batches; grouprl divides by the mini-batch's token total over all
processes (``num_tokens``, the update's normalisers), so that the micro-batch bonuses add up to
the mini-batch's token mean exactly. The two agree when every micro-batch holds the same number
of tokens. verl and EasyR1 (< 0.3) aggregate their entropy with ``loss_agg_mode``; the two agree
under ``token-mean``, their default.
"""

from __future__ import annotations

import math

from torch import Tensor

from grouprl.algorithms.aggregation import token_mean


def entropy_bonus(entropy: Tensor, mask: Tensor, *, num_tokens: float | None = None) -> Tensor:
    """H = sum_{i,t} H_{i,t} M_{i,t} / N: the token mean of the per-token entropy.

    ``entropy`` [B, T] is ``H_{i,t} = -sum_v p_v log p_v`` of the policy's distribution at each
    response position (differentiable for the bonus to train), ``mask`` the loss mask, ``N``
    = ``num_tokens`` (the mini-batch's token total over all processes, so that the micro-batch
    values sum to the mini-batch's mean, in value and gradient) or ``sum(M)``; 0 when N = 0.
    Masked positions add exactly 0, even where the entropy is nan there.
    """
    return token_mean(entropy, mask, num_tokens=num_tokens)


def adaptive_entropy_coef(coef: float, entropy: float, *, target: float, coef_min: float, coef_max: float,
                          delta: float) -> float:
    """The coefficient after one optimizer step of Skywork-OR1's controller (TRL's ``use_adaptive_entropy``).

    ``c' = min(c + delta, coef_max)`` if ``H <= target`` else ``max(c - delta, coef_min)``, with
    ``H`` the step's token-weighted mean entropy over every process. A non-finite ``H`` (a step
    whose entropy could not be measured) is refused: a silent step in either direction would
    move the coefficient on nothing.
    """
    if not math.isfinite(entropy):
        raise ValueError(f"the adaptive entropy coefficient needs a finite entropy; got {entropy}")
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coef(coef: float, last_entropy: float, *, adaptive: bool, target: float) -> float:
    """The coefficient the loss uses: ``c``, or under the adaptive controller ``c`` if the last measured
    entropy ``<= target`` else 0 (TRL's gating; ``last_entropy`` is +inf before the first
    measurement, so the first optimizer step has no bonus)."""
    if adaptive and not last_entropy <= target:
        return 0.0
    return coef
