"""On-policy distillation: a teacher's log-probs of the student's own sampled tokens as a per-token advantage.

Notation (all [B, R]): s = log pi_student_old(y_t), the policy that sampled y_t; t = log pi_teacher(y_t)
on the same prefix, at the same temperature; m = response mask.

The per-token reverse KL KL(s || t) = sum_y s(y) (log s(y) - log t(y)) has the gradient

    grad KL = sum_y s(y) (log s(y) - log t(y)) grad log s(y)      (as sum_y s(y) grad log s(y) = 0)
            = -E_{y ~ student}[(log t(y) - log s(y)) grad log s(y)],

a policy gradient whose advantage is A^distill_t = log t(y_t) - log s(y_t) (Thinking Machines' on-policy
distillation; verl's ``use_policy_gradient`` with the k1 estimator). A sampled token costs one teacher
log-prob, not the teacher's full distribution: the single-sample estimate of what TRL's
``DistillationTrainer`` (``beta=1``) differentiates exactly over the vocabulary. In expectation over
y ~ student the two agree, the loss value and its gradient both (tests/core/test_distillation.py
enumerates the vocabulary to check it against TRL's ``_chunked_divergence_loss``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl_advantages(teacher_log_probs: Tensor, student_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """A^distill = m * (t - s): the teacher's log-prob of each sampled token less the sampling student's.

    Positive where the teacher likes the sampled token more than the student does. Masked positions
    are exactly 0 (a select: padding may hold any value, nan included).
    """
    if teacher_log_probs.shape != student_log_probs.shape or student_log_probs.shape != response_mask.shape:
        raise ValueError(f"teacher log-probs {tuple(teacher_log_probs.shape)}, student log-probs "
                         f"{tuple(student_log_probs.shape)} and response mask {tuple(response_mask.shape)} "
                         "must have the same shape")
    gap = teacher_log_probs.detach() - student_log_probs.detach()
    return torch.where(response_mask != 0, gap, torch.zeros_like(gap))


def mix_advantages(reward_advantages: Tensor | None, distill_advantages: Tensor, distill_coef: float) -> Tensor:
    """A = A^rewards + c * A^distill, per token ([B, R]); A^rewards = 0 when the run has no reward
    (pure distillation). c = 0: the rewards alone."""
    if reward_advantages is None:
        return distill_coef * distill_advantages
    return reward_advantages + distill_coef * distill_advantages
