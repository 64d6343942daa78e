"""DiffusionNFT's objective (Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward
Process", arXiv 2509.16117): reinforcement on the forward (noising) process of clean samples.

No likelihoods and no stored trajectories: the sampler may be any solver (an ODE, a few-step
solver, with or without CFG), and only each sample's clean latent ``x0`` and its reward are kept.
Training noises ``x0`` afresh at some times t, ``x_t = (1 - t) x0 + t eps`` (rectified flow, so
the target velocity is ``v = eps - x0``), and pulls the policy's velocity between two implicit
policies built from it and the frozen "old" policy that sampled the data:

    v+ = (1 - beta) v_old + beta v_theta        (the implicit positive policy)
    v- = (1 + beta) v_old - beta v_theta        (the implicit negative policy)
    L  = r ||v+ - v||^2 + (1 - r) ||v- - v||^2

with ``r`` in [0, 1] the sample's reward made an "optimality probability". Minimising L moves
v+ towards the well-rewarded samples' velocities and v- towards the poorly rewarded ones', i.e.
v_theta = v_old + (v+ - v_old) / beta away from the bad and towards the good.

Every function is pure: per-sample tensors of shape [B] (velocities and latents [B, ...]) in,
float32 [B] out; the caller averages over samples and times and adds its KL term.
"""

from __future__ import annotations

import torch
from torch import Tensor


def optimality_probability(advantages: Tensor, adv_clip_max: float = 5.0) -> Tensor:
    """``r = clip(A, -c, c) / (2 c) + 1/2`` in [0, 1], float32 [B], from group-relative advantages A.

    The paper normalises the reward into an optimality probability; its code does it from the
    clipped advantage with ``c = adv_clip_max`` (5): A = 0 (a sample as good as its group) gives
    r = 1/2, where the positive and negative terms pull equally and the gradient is the
    old policy's regression alone.
    """
    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be > 0; got {adv_clip_max}")
    if advantages.dim() != 1:
        raise ValueError(f"advantages must have shape [B]; got {tuple(advantages.shape)}")
    clipped = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    return (clipped / (2 * adv_clip_max) + 0.5).clamp(0.0, 1.0)


def forward_noised(x0: Tensor, noise: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """``(x_t, v)``: ``x_t = (1 - t) x0 + t eps`` and the target velocity ``v = eps - x0``; t is [B] in [0, 1]."""
    if x0.shape != noise.shape:
        raise ValueError(f"x0 and noise must have one shape; got {tuple(x0.shape)} and {tuple(noise.shape)}")
    if t.shape != (x0.shape[0],):
        raise ValueError(f"t must have shape ({x0.shape[0]},); got {tuple(t.shape)}")
    t_ = t.to(device=x0.device, dtype=x0.dtype).reshape(-1, *([1] * (x0.dim() - 1)))
    noise = noise.to(x0)
    return (1 - t_) * x0 + t_ * noise, noise - x0


def nft_loss(
    v_theta: Tensor,
    v_old: Tensor,
    target: Tensor,
    r: Tensor,
    beta: float,
    *,
    t: Tensor | None = None,
    adaptive_weighting: bool = True,
    adv_clip_max: float = 5.0,
) -> Tensor:
    """DiffusionNFT's loss per sample, float32 [B].

    ``v+ = (1 - beta) v_old + beta v_theta``, ``v- = (1 + beta) v_old - beta v_theta`` (``v_old``
    detached: the old policy is data, not trained), then

    - ``adaptive_weighting=False``, the paper's loss as written:
      ``L = r mean(|v+ - v|^2) + (1 - r) mean(|v- - v|^2)`` (means over the latent's elements);
    - ``adaptive_weighting=True`` (NVlabs' released code, the default): each term in x0-space,
      ``e = t (v - v±)`` = the clean-sample error of that policy's one-step prediction
      ``x_t - t v±``, divided by its own detached mean absolute value (at least 1e-5):
      ``L = [r mean(e+^2) / w+ + (1 - r) mean(e-^2) / w-] / beta * adv_clip_max`` with
      ``w± = mean|e±|``. Self-normalising the terms keeps the gradient's scale the same at
      every t and noise draw; the 1 / beta and adv_clip_max factors are the code's, which make
      the gradient independent of beta at v_theta = v_old (``d v+ / d v_theta = beta``).

    ``target`` is the rectified-flow velocity ``eps - x0`` (``forward_noised``), ``r`` the
    optimality probability [B] (``optimality_probability``), ``beta`` > 0 the step of the implicit
    policies (the paper's 0.1 for OCR, 1.0 otherwise), ``t`` [B] the noising time (needed for
    the adaptive weighting).
    """
    if not beta > 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if not (v_theta.shape == v_old.shape == target.shape):
        raise ValueError(f"v_theta, v_old and target must have one shape; got {tuple(v_theta.shape)}, "
                         f"{tuple(v_old.shape)}, {tuple(target.shape)}")
    if r.shape != (v_theta.shape[0],):
        raise ValueError(f"r must have shape ({v_theta.shape[0]},); got {tuple(r.shape)}")
    v_old = v_old.detach().float()
    v_theta, target = v_theta.float(), target.float()
    positive = (1 - beta) * v_old + beta * v_theta
    negative = (1 + beta) * v_old - beta * v_theta
    dims = tuple(range(1, v_theta.dim()))
    r = r.float()
    if not adaptive_weighting:
        return r * (positive - target).pow(2).mean(dims) + (1 - r) * (negative - target).pow(2).mean(dims)
    if t is None or t.shape != (v_theta.shape[0],):
        raise ValueError("adaptive weighting needs t, the noising time of each sample, of shape [B]")
    t_ = t.float().reshape(-1, *([1] * (v_theta.dim() - 1)))

    def weighted(velocity: Tensor) -> Tensor:
        error = t_ * (target - velocity)  # x_t - t velocity - x0
        with torch.no_grad():
            weight = error.double().abs().mean(dims, keepdim=True).clamp(min=1e-5).float()
        return (error.pow(2) / weight).mean(dims)

    return (r * weighted(positive) + (1 - r) * weighted(negative)) / beta * adv_clip_max


def old_policy_decay(step: int, *, flat: int = 0, rate: float = 0.001, ceiling: float = 0.5) -> float:
    """The decay of the old policy's moving average after training step ``step``.

    After every step the old adapter becomes ``old <- d old + (1 - d) theta`` with
    ``d = min(max(step - flat, 0) * rate, ceiling)`` (0 while ``step < flat``): early on the old
    policy follows the trained one closely (d near 0, on-policy), later it lags (off-policy,
    more stable). NVlabs' schedules: ``flat 0, rate 0.001, ceiling 0.5`` (their default) and
    ``flat 75, rate 0.0075, ceiling 0.999`` (OCR).
    """
    if step < flat:
        return 0.0
    return min((step - flat) * rate, ceiling)


@torch.no_grad()
def update_old_policy(old: list[Tensor], trained: list[Tensor], decay: float) -> None:
    """In place: ``old_i <- decay old_i + (1 - decay) trained_i`` for each pair of tensors."""
    if len(old) != len(trained):
        raise ValueError(f"{len(old)} old tensors for {len(trained)} trained ones")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay must be in [0, 1]; got {decay}")
    for o, p in zip(old, trained, strict=True):
        if o.shape != p.shape:
            raise ValueError(f"shape mismatch between old {tuple(o.shape)} and trained {tuple(p.shape)}")
        o.mul_(decay).add_(p.detach().to(o.dtype), alpha=1.0 - decay)
