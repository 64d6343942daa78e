"""verl's rollout correction in the GRPO step: decoupled (once per batch) and bypass (the old log-probs).

The math is :mod:`grouprl.algorithms.rollout_correction`, ``rollout_rejection`` and
``rollout_bypass``; the setting is ``grouprl.config.rollout_correction.VerlRolloutCorrection``.
Here: which rows are corrected (a row a rollout transform rewrote was never sampled, so it is
left as it is), the cross-process mean for batch normalisation, and the metrics
(``rollout_corr/<verl's name>``, each a weighted mean across processes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grouprl import algorithms
from grouprl.config.rollout_correction import VerlRolloutCorrection
from grouprl.rollout.batch import RolloutBatch
from grouprl.trainer.metrics import StepMetrics

PREFIX = "rollout_corr/"


def record(metrics: StepMetrics, values: dict[str, tuple[float, float]]) -> None:
    for key, (value, weight) in values.items():
        metrics.mean(PREFIX + key, value, weight)


def correct_decoupled(batch: RolloutBatch, verl: VerlRolloutCorrection, metrics: StepMetrics, *,
                      sum_over_processes: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Decoupled mode: IS weights into ``batch.token_weights`` and the rejection mask into ``batch.loss_mask``,
    between the trainer's ``old_log_probs`` and the sampler's ``rollout_log_probs``, as verl's
    ``compute_rollout_correction_and_add_to_batch``. Batch normalisation divides by the mean over
    every process's sampled rows (``is_weight_totals`` summed by ``sum_over_processes``)."""
    sampled = ~batch.edited.unsqueeze(-1)
    # edited rows count as empty here: their rollout log-probs are nan and never read
    mask = batch.loss_mask * sampled.to(batch.loss_mask.dtype)
    weights, keep, values = algorithms.rollout_correction_terms(
        batch.old_log_probs, batch.rollout_log_probs, mask, rollout_is=verl.rollout_is,
        rollout_is_threshold=verl.rollout_is_threshold, rollout_rs=verl.rollout_rs,
        rollout_rs_threshold=verl.rollout_rs_threshold)
    if weights is not None:
        if verl.rollout_is_batch_normalize:
            totals = sum_over_processes(algorithms.is_weight_totals(weights, mask, level=verl.rollout_is))
            weights, factor = algorithms.batch_normalized_weights(weights, totals)
            values["rollout_is_batch_norm_factor"] = (factor, 1.0)
        batch.token_weights = torch.where(sampled, weights, batch.loss_mask.to(weights.dtype))
    batch.loss_mask = torch.where(sampled, keep.to(batch.loss_mask.dtype), batch.loss_mask)
    record(metrics, values)


def bypass_old_log_probs(batch: RolloutBatch, trainer_log_probs: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Bypass mode's old log-probs: the sampler's; for rows a transform rewrote (never sampled, their
    rollout log-probs nan) the trainer's, computed only when there are such rows."""
    if not bool(batch.edited.any()):
        return batch.rollout_log_probs
    return torch.where(batch.edited.unsqueeze(-1), trainer_log_probs(), batch.rollout_log_probs)
