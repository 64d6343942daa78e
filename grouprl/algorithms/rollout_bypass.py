"""Bypass mode (verl's rollout correction with two policies): the sampler's log-probs serve as the old ones.

In decoupled mode there are three policies: pi_rollout (sampled), pi_old (the trainer's
recomputed log-probs, the PPO anchor) and pi_theta (being trained); the IS weights and the
rejection mask correct pi_old against pi_rollout once per batch. Bypass mode skips the
recompute: old_log_prob := rollout_log_prob, and the correction is computed on every
micro-batch between the current policy and the sampler, r_t = pi_theta(y_t) / pi_rollout(y_t)
(verl 0.9.1 ``compute_policy_loss_bypass_mode``):

- keep = ``rollout_rejection_mask(sg(log pi_theta), log pi_rollout, m, ...)`` (m when no ``rollout_rs``);
- w = ``threshold_importance_weights(sg(log pi_theta), log pi_rollout, m, ...)`` (none when no
  ``rollout_is``), divided by its mean over this call's batch when ``rollout_is_batch_normalize``;
- ``loss_type="ppo_clip"``:  the configured policy loss with ratio pi_theta / pi_rollout on mask
  keep; w is not applied (the ratio already carries the correction, its clip bounds it);
- ``loss_type="reinforce"``: l_t = -sg(w_t) A_t log pi_theta(y_t) on mask keep (``reinforce`` loss;
  without ``rollout_is``, plain REINFORCE).

Aggregation takes ``keep`` as the mask and the caller's ``num_tokens`` / ``num_seqs`` (counted
on the unrejected mask), as verl's global batch sizes are: a rejected token adds 0 to the sum
and still counts in a global token-mean's denominator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grouprl.algorithms.policy_losses import compute_policy_loss
from grouprl.algorithms.rollout_correction import (
    batch_normalized_weights,
    importance_weight_metrics,
    is_weight_totals,
    off_policy_metrics,
    threshold_importance_weights,
)
from grouprl.algorithms.rollout_rejection import rollout_rejection_mask

BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


def rollout_correction_terms(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float = 2.0,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[Tensor | None, Tensor, dict[str, tuple[float, float]]]:
    """(w, keep, metrics) between ``log_prob`` (the trainer's) and the sampler's, without gradient:
    w = ``threshold_importance_weights`` (None without ``rollout_is``), keep = ``rollout_rejection_mask``
    (``response_mask`` without ``rollout_rs``), and metrics under verl's names (no ``rollout_corr/`` prefix):
    ``importance_weight_metrics``, the rejection metrics and ``off_policy_metrics``, each (value, weight).
    w is not batch-normalised here (the caller chooses over which rows: ``is_weight_totals``)."""
    log_prob = log_prob.detach()
    metrics: dict[str, tuple[float, float]] = {}
    weights = None
    if rollout_is is not None:
        weights = threshold_importance_weights(log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
                                               rollout_is_threshold=rollout_is_threshold)
        metrics.update(importance_weight_metrics(weights, log_prob, rollout_log_prob, response_mask,
                                                 rollout_is=rollout_is, rollout_is_threshold=rollout_is_threshold))
    keep = response_mask
    if rollout_rs is not None:
        keep, rs_metrics = rollout_rejection_mask(log_prob, rollout_log_prob, response_mask, rollout_rs=rollout_rs,
                                                  rollout_rs_threshold=rollout_rs_threshold)
        metrics.update(rs_metrics)
    metrics.update(off_policy_metrics(log_prob, rollout_log_prob, response_mask))
    return weights, keep, metrics


def compute_bypass_policy_loss(
    log_prob: Tensor,
    rollout_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    loss_type: str = "ppo_clip",
    policy_loss: str = "vanilla",
    rollout_is: str | None = None,
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
    loss_agg_mode: str = "token-mean",
    **options,
) -> tuple[Tensor, dict[str, float], dict[str, tuple[float, float]]]:
    """Bypass-mode loss (module docstring): (scalar loss, the policy loss's metrics, correction metrics).

    ``options`` are ``compute_policy_loss``'s (``num_tokens`` / ``num_seqs`` / ``norm_len``, and the
    options of the loss used: ``policy_loss``'s for ppo_clip, none for ``reinforce``). With
    ``rollout_is_batch_normalize`` the weights are divided by their mean over this call's rows
    (``is_weight_totals``) and ``rollout_is_batch_norm_factor`` is added to the correction metrics.
    ValueError for an unknown ``loss_type``.
    """
    if loss_type not in BYPASS_LOSS_TYPES:
        raise ValueError(f"unknown bypass loss_type {loss_type!r}; valid: {', '.join(BYPASS_LOSS_TYPES)}")
    with torch.no_grad():
        weights, keep, metrics = rollout_correction_terms(
            log_prob, rollout_log_prob, response_mask, rollout_is=rollout_is,
            rollout_is_threshold=rollout_is_threshold, rollout_rs=rollout_rs, rollout_rs_threshold=rollout_rs_threshold)
        if weights is not None and rollout_is_batch_normalize:
            weights, factor = batch_normalized_weights(weights, is_weight_totals(weights, response_mask,
                                                                                 level=rollout_is))
            metrics["rollout_is_batch_norm_factor"] = (factor, 1.0)
    if loss_type == "reinforce":
        name, token_weights = "reinforce", weights
    else:
        name, token_weights = policy_loss, None  # the ratio pi_theta / pi_rollout is the correction
    loss, pg_metrics = compute_policy_loss(name, log_prob, rollout_log_prob, advantages, keep,
                                           loss_agg_mode=loss_agg_mode, token_weights=token_weights, **options)
    return loss, pg_metrics, metrics
