"""Flow-GRPO objective terms, per sample and per denoising step: KL, clipped loss, GRPO-Guard, advantages.

Notation (see ``grouprl.domains.diffusion.scheduler``): one SDE step from t to t' < t, dt = t' - t < 0,
mu = the step's Gaussian mean, sigma_t = the noise level (Flow-GRPO's a sqrt(t / (1 - t))),
std = s = the step's standard deviation (sigma_t sqrt|dt| for kind ``sde``), A = advantage,
r = exp(log p_theta - log p_old). Each log-probability is a mean over the latent's C, H, W
elements, so ratios stay within about 1e-4 of 1 and the clip ranges are tiny (1e-4 .. 2e-6).

Every function takes per-sample tensors of shape [B] (means of shape [B, ...]) and returns
float32 [B]; the caller averages over samples and steps and adds beta * KL.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grouprl.algorithms.advantages import compute_advantages, dense_group_index
from grouprl.algorithms.policy_losses import vanilla_policy_loss


def _per_sample(value: float | Tensor, batch: int, device: torch.device, name: str) -> Tensor:
    """A python float, 0-d tensor or [B] tensor as a float32 [B] tensor on ``device``."""
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.dim() == 0:
        tensor = tensor.expand(batch)
    elif tensor.shape != (batch,):
        raise ValueError(f"{name} must be a float, a 0-d tensor or a tensor of shape ({batch},); got {tuple(tensor.shape)}")
    return tensor.to(device)


def _check_positive(value: Tensor, name: str) -> None:
    # A zero here is an ODE step (noise level 0) slipping into a term that divides by it.
    if not bool((value > 0).all()):
        raise ValueError(f"{name} must be > 0 for every sample (an ODE step has no density); got {value.tolist()}")


def _mean_squared_distance(mean: Tensor, other_mean: Tensor) -> Tensor:
    """[B]: mean over non-batch dims of (mean - other_mean)^2, in float32."""
    if mean.shape != other_mean.shape:
        raise ValueError(f"the two means must have one shape; got {tuple(mean.shape)} and {tuple(other_mean.shape)}")
    return (mean.float() - other_mean.float()).pow(2).reshape(mean.shape[0], -1).mean(dim=1)


def _check_per_sample(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 1:
        raise ValueError("expected tensors of one shape [B]; got " + ", ".join(f"{n} {s}" for n, s in shapes.items()))


def flow_kl(mean: Tensor, ref_mean: Tensor, sigma_t: float | Tensor) -> Tensor:
    """KL penalty towards the reference model: mean over C, H, W of (mu_theta - mu_ref)^2 / (2 sigma_t^2), [B].

    Two Gaussian steps with one std s have KL = mean (mu_theta - mu_ref)^2 / (2 s^2), and for
    kind ``sde`` s^2 = sigma_t^2 |dt|. The public Flow-GRPO code divides by 2 sigma_t^2 alone,
    i.e. it omits |dt| (its KL is the true one times |dt|, smaller at small steps). So the
    divisor is an explicit argument:
      - ``sigma_t`` = the noise level sigma_t reproduces the public code (and its beta values);
      - ``sigma_t`` = the step's std (``SDEStepOutput.std``) gives the exact per-step KL; for CPS,
        whose public code passes the step std, that is also the public value.
    ``sigma_t`` is a float, 0-d tensor or per-sample [B] tensor, > 0. ``ref_mean`` is detached:
    the penalty moves the policy towards the reference, never the reverse.
    """
    distance = _mean_squared_distance(mean, ref_mean.detach())
    scale = _per_sample(sigma_t, distance.shape[0], distance.device, "sigma_t")
    _check_positive(scale, "sigma_t")
    return distance / (2 * scale**2)


def clipped_policy_loss(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, clip_range: float
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clip per sample: (loss [B], ratio [B], clipped [B] bool).

    loss = max(-A r, -A clip(r, 1 - eps, 1 + eps)), r = exp(clamp(log p_theta - log p_old, -20, 20)),
    eps = ``clip_range``; it is grouprl's ``vanilla`` policy loss with a symmetric range, applied to
    one log-probability per sample and step instead of per token. ``ratio`` is detached (for
    metrics). ``clipped`` marks samples where a bound is active and the gradient vanishes
    (A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps); the public code's clipfrac counts
    |r - 1| > eps whatever the sign of A, which is larger (``ratio_outside_clip``).
    For GRPO-Guard pass the normalised log-ratio as ``log_prob`` and zeros as ``old_log_prob``.
    """
    _check_per_sample(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0; got {clip_range}")
    log_prob = log_prob.float()
    terms = vanilla_policy_loss(
        log_prob,
        old_log_prob.float(),
        advantages.float(),
        torch.ones_like(log_prob),
        clip_ratio_low=clip_range,
        clip_ratio_high=clip_range,
    )
    return terms.loss, terms.ratio, terms.clipped_low | terms.clipped_high


def ratio_outside_clip(ratio: Tensor, clip_range: float) -> Tensor:
    """The peers' clip fraction's rows (flow_grpo, MM-GRPO, verl-omni ``clipfrac``): |r - 1| > eps, [B] bool.

    It counts a row whatever the sign of A, so it is at least the share of rows whose gradient the clip
    zeroes (``clipped_policy_loss``'s ``clipped``: A > 0 and r > 1 + eps, or A < 0 and r < 1 - eps);
    on one run the two read e.g. 0.54-0.99 and 0.31-0.52. The flow trainer logs this as
    ``actor/clipfrac`` and the other as ``actor/clipped_grad_frac``.
    """
    if not clip_range > 0:
        raise ValueError(f"clip_range must be > 0; got {clip_range}")
    return (ratio.float() - 1).abs() > clip_range


def guard_log_ratio(
    log_prob: Tensor, old_log_prob: Tensor, mean: Tensor, old_mean: Tensor, std: float | Tensor
) -> Tensor:
    """GRPO-Guard RatioNorm: the normalised log-ratio (log p_theta - log p_old + b) * s, [B].

    Why: x' was drawn from N(mu_old, s^2); with dmu = mu_theta - mu_old,
    E[log p_theta(x') - log p_old(x')] = -mean(dmu^2) / (2 s^2) < 0, so r drifts below 1, most at
    the low-noise steps (small s), and the upper clip stops restraining positive-advantage
    updates. Adding b = mean(dmu^2) / (2 s^2) removes that drift and the factor s puts every step
    on one scale: the result is mean_CHW(eps * dmu) with eps ~ N(0, I) the rollout noise.

    The two published forms:
      - GRPO-Guard / MM-GRPO: s = sqrt|dt| sigma_bar_t, b = mean_CHW(dmu^2) / (2 (sqrt|dt| sigma_bar_t)^2),
        r~ = exp((log p_theta - log p_old + b) sqrt|dt| sigma_bar_t);
      - verl-omni: s = mean_batch(sqrt|dt|) * mean_batch(sigma_t), the same b and r~ with that s
        (and the loss divided by mean_batch(sqrt|dt|)^2).
    Implemented: the per-sample form, s = ``std`` = each sample's step std (sigma_t sqrt|dt| for
    kind ``sde``; the derivation only uses x' ~ N(mu_old, s^2), so CPS's std works too). It
    equals both forms when a batch shares one timestep, the usual layout, and stays exact when
    a batch mixes timesteps, where batch means would mix the scales of different steps.

    ``std``: float, 0-d or [B], > 0 (SDE steps only). ``mean`` [B, ...] is mu_theta with its
    graph; ``old_mean`` is mu_old stored at rollout time (detached). b is not detached, as
    written in both forms: its gradient cancels that of the drift term too. Use
    r~ = exp(result), e.g. ``clipped_policy_loss(result, torch.zeros_like(result), A, eps)``.
    """
    _check_per_sample(log_prob=log_prob, old_log_prob=old_log_prob)
    distance = _mean_squared_distance(mean, old_mean.detach())
    if distance.shape != log_prob.shape:
        raise ValueError(f"mean has {distance.shape[0]} samples but log_prob has shape {tuple(log_prob.shape)}")
    scale = _per_sample(std, distance.shape[0], distance.device, "std")
    _check_positive(scale, "std")
    bias = distance / (2 * scale**2)
    return (log_prob.float() - old_log_prob.float() + bias) * scale


def guard_reweight(loss: Tensor, dt: float | Tensor) -> Tensor:
    """GRPO-Guard's gradient reweighting: loss / |dt|, per sample ([B]).

    After RatioNorm the gradient of step t scales with its step size; dividing by |dt| evens the
    steps out (verl-omni divides by mean_batch(sqrt|dt|)^2, the same for a one-timestep batch).
    Apply it to the clipped policy loss only and add the KL term afterwards.
    ``dt`` = sigma_next - sigma (either sign is accepted; its magnitude is used), float, 0-d or [B].
    """
    if loss.dim() != 1:
        raise ValueError(f"loss must have shape [B]; got {tuple(loss.shape)}")
    step = _per_sample(dt, loss.shape[0], loss.device, "dt").abs()
    _check_positive(step, "|dt|")
    return loss.float() / step


def _group_index(group_ids_or_group_size: Any, batch: int, device: torch.device) -> Tensor:
    """Dense group numbers [B]; an int g means consecutive groups of g rows (0..g-1, g..2g-1, ...)."""
    if isinstance(group_ids_or_group_size, int) and not isinstance(group_ids_or_group_size, bool):
        size = group_ids_or_group_size
        if size < 1 or batch % size:
            raise ValueError(f"group size {size} must be >= 1 and divide the batch of {batch} rewards")
        return torch.arange(batch, device=device) // size
    return dense_group_index(group_ids_or_group_size, batch, device=device)


def group_advantages(
    rewards: Tensor,
    group_ids_or_group_size: Any,
    *,
    global_std: bool = True,
    clip: float | None = 5.0,
    eps: float = 1e-4,
    batch_std: float | None = None,
) -> Tensor:
    """Flow-GRPO advantages, float32 [B], the same at every denoising step of a sample.

    A_i = clip((R_i - mean_g) / (std + eps), -clip, clip), mean_g = mean of row i's group, and
      - ``global_std=True`` (Flow-GRPO's default): std = standard deviation of the whole batch
        (``batch_std`` when the batch spans other processes' rows too, else that of ``rewards``);
      - ``global_std=False``: std = std_g, that of row i's group.
    Groups: an int g (consecutive groups of g rows) or any group ids ``dense_group_index``
    accepts, prompt strings included. ``clip=None`` turns clipping off.

    Both forms are grouprl's ``grpo`` estimator, at ``std_level`` batch or group. Both use the
    unbiased std (n - 1), as ``grpo`` does; Flow-GRPO's numpy code uses the population std (n),
    so its advantages are larger by sqrt(n / (n - 1)) (3% for a group of 16 with
    ``global_std=False``, negligible over a batch). A group of one sample, or of equal rewards,
    gets A = 0. Statistics in float64, as in ``grouprl.algorithms``.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape [B]; got {tuple(rewards.shape)}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None; got {clip}")
    rewards64 = rewards.to(torch.float64)
    groups = _group_index(group_ids_or_group_size, rewards.shape[0], rewards.device)
    if global_std:
        advantages = compute_advantages("grpo", rewards64, groups, std_level="batch", batch_std=batch_std, eps=eps)
    else:
        advantages = compute_advantages("grpo", rewards64, groups, std_level="group", eps=eps)
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages.to(torch.float32)
