"""Flow-GRPO sampling math for rectified-flow models: SDE steps with log-probabilities, CFG, schedules.

Notation: rectified flow with t = sigma in [0, 1] and x_t = (1 - t) x0 + t eps, so t = 1 is
pure noise and t = 0 the clean sample; v = velocity predicted by the model; a step goes from
t = ``sigma`` to t' = ``sigma_next`` < t, dt = t' - t < 0.

Sampling replaces the deterministic Euler step x' = x + v dt by a Gaussian transition
x' ~ N(mu, std^2) whose marginals match the ODE's, so every step has a log-probability that
can be recomputed under new weights (the policy of GRPO). Two transitions are provided:

- ``sde`` (Flow-GRPO): sigma_t = a sqrt(t / (1 - t)),
  mu = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt,  std = sigma_t sqrt(-dt);
- ``cps`` (coefficients-preserving sampling, arXiv 2509.05952): std = t' sin(a pi / 2),
  mu = (1 - t') x0_hat + sqrt(t'^2 - std^2) x1_hat, x0_hat = x - t v, x1_hat = x + (1 - t) v.

a = ``noise_level``; a = 0 is the plain Euler ODE step for both. Everything here is computed
in float32 and returns float32: in bf16 or fp16 the mean's small correction terms and the
squared residuals of a log-density over ~65k latent elements lose most of their digits.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

SDE_KINDS = ("sde", "cps")
_HALF_LOG_TWO_PI = 0.5 * math.log(2.0 * math.pi)


class SDEStepOutput(NamedTuple):
    """One sampling step.

    ``prev_sample`` [B, ...]: x' (detached: it is data, stored and re-scored later);
    ``log_prob`` [B]: mean over the non-batch dims of log N(x'; mu, std^2);
    ``mean`` [B, ...]: mu, still attached to the velocity's graph (the KL and GRPO-Guard need it);
    ``std`` [B]: the step's standard deviation (0 for an ODE step).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor


# ---------------------------------------------------------------------------
# Shapes and checks
# ---------------------------------------------------------------------------


def _per_sample(value: float | Tensor, batch: int, device: torch.device, name: str) -> Tensor:
    """A python float, 0-d tensor or [B] tensor as a float32 [B] tensor on ``device``."""
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.dim() == 0:
        tensor = tensor.expand(batch)
    elif tensor.shape != (batch,):
        raise ValueError(f"{name} must be a float, a 0-d tensor or a tensor of shape ({batch},); got {tuple(tensor.shape)}")
    return tensor.to(device)


def _check_sigmas(sigma: Tensor, sigma_next: Tensor) -> None:
    # A step must go strictly towards the data (dt < 0): dt = 0 gives std 0 and a log-density
    # of a point mass, dt > 0 a sqrt of a negative number; both are caller bugs, not edge cases.
    valid = (sigma_next >= 0) & (sigma_next < sigma) & (sigma <= 1)
    if not bool(valid.all()):
        raise ValueError(
            "sigma and sigma_next must satisfy 0 <= sigma_next < sigma <= 1 (a step towards the data); "
            f"got sigma={sigma.tolist()}, sigma_next={sigma_next.tolist()}"
        )


def _check_noise_level(noise_level: float, kind: str) -> None:
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}; valid kinds: {', '.join(SDE_KINDS)}")
    if not noise_level >= 0:
        raise ValueError(f"noise_level must be >= 0; got {noise_level}")
    # CPS parametrises std = sigma_next sin(a pi / 2): past a = 1 the sine folds back (a and 2 - a
    # give the same step), so a larger value is almost surely a mistake for the SDE kind's scale.
    if kind == "cps" and noise_level > 1:
        raise ValueError(f"noise_level must be in [0, 1] for kind 'cps'; got {noise_level}")


def _batch_view(per_sample: Tensor, like: Tensor) -> Tensor:
    """[B] -> [B, 1, ..., 1] so that it broadcasts over ``like``'s non-batch dims."""
    return per_sample.view(-1, *([1] * (like.dim() - 1)))


def _standard_normal(shape: torch.Size, generator: torch.Generator | None, device: torch.device) -> Tensor:
    # Drawn on the generator's device and then moved, so that a CPU generator gives the same
    # noise whatever device the latents are on (as diffusers' randn_tensor does).
    draw_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=draw_device, dtype=torch.float32).to(device)


# ---------------------------------------------------------------------------
# Transition kernels
# ---------------------------------------------------------------------------


def sde_sigma_t(sigma: float | Tensor, sigma_next: float | Tensor, noise_level: float) -> Tensor:
    """Flow-GRPO's noise level sigma_t = a sqrt(t / (1 - t)), t = ``sigma``, a = ``noise_level``.

    At t = 1 the formula is infinite; Flow-GRPO puts 1 - sigma_1 in the denominator, sigma_1
    being the schedule's first sigma below 1. The only step that starts at t = 1 is the first
    one, whose ``sigma_next`` is exactly sigma_1, so this uses 1 - ``sigma_next`` there: the same
    value as the public code for any schedule that starts at 1, with no schedule to look up.
    Returns float32 with the broadcast shape of the two sigmas (a 0-d tensor for floats).
    """
    t = torch.as_tensor(sigma, dtype=torch.float32)
    t_next = torch.as_tensor(sigma_next, dtype=torch.float32).to(t.device)
    # ``>=`` rather than ``==``: a schedule rounded a hair above 1 must not divide by ~0 either.
    denominator_t = torch.where(t >= 1, t_next, t)
    return noise_level * torch.sqrt(t / (1 - denominator_t))


def _gaussian_log_prob(sample: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """[B]: mean over non-batch dims of -(x' - mu)^2 / (2 std^2) - log std - 0.5 log 2 pi; 0 where std = 0.

    std is constant within a sample, so the mean of the per-element density is
    -mean((x' - mu)^2) / (2 std^2) - log std - 0.5 log 2 pi. A sample with std = 0 (an ODE
    step, or CPS's last step into sigma = 0) has no density; 0 is returned for it, and the
    division uses std = 1 there so that neither the value nor the gradient becomes nan.
    """
    positive = std > 0
    safe_std = torch.where(positive, std, torch.ones_like(std))
    squared = (sample - mean).pow(2).reshape(sample.shape[0], -1).mean(dim=1)
    log_prob = -squared / (2 * safe_std**2) - torch.log(safe_std) - _HALF_LOG_TWO_PI
    return torch.where(positive, log_prob, torch.zeros_like(log_prob))


def sde_step(
    velocity: Tensor,
    sample: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    kind: str = "sde",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStepOutput:
    """One stochastic step from t = ``sigma`` to t' = ``sigma_next`` with its log-probability.

    ``velocity`` and ``sample`` are [B, ...] (cast to float32); ``sigma`` and ``sigma_next`` are
    python floats, 0-d tensors or per-sample [B] tensors, with 0 <= t' < t <= 1. dt = t' - t.

    kind ``sde`` (Flow-GRPO):
        sigma_t = a sqrt(t / (1 - t))   (1 - t' in the denominator at t = 1, see ``sde_sigma_t``)
        mu  = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt
        std = sigma_t sqrt(-dt)
    kind ``cps`` (coefficients-preserving sampling):
        std = t' sin(a pi / 2);  x0_hat = x - t v;  x1_hat = x + (1 - t) v
        mu  = (1 - t') x0_hat + sqrt(t'^2 - std^2) x1_hat
    log_prob = mean over non-batch dims of -(x' - mu)^2 / (2 std^2) - log std - 0.5 log 2 pi.

    For CPS this is the true Gaussian log-density, not the public code's -mean (x' - mu)^2 (which
    drops the constants and the 1 / (2 std^2) factor). The constants cancel in a ratio, the
    factor does not: log r here is the public log r divided by 2 std^2 (std does not depend on
    the weights), so clip ranges tuned on the public CPS code do not carry over. The density was
    chosen so that both kinds return the same quantity, a real log-probability whose ratios and
    KL have their usual meaning (and the log-probability checks hold for both).

    Without ``prev_sample`` x' = mu + std * eps, eps ~ N(0, I) drawn with ``generator``, and x'
    is detached. With ``prev_sample`` (the stored next latent) nothing is drawn: x' is that
    tensor (detached), and ``log_prob`` carries gradients through ``velocity`` via mu -- this
    re-scoring under the current weights is what training differentiates.

    ``noise_level`` = 0 is the plain Euler ODE step for both kinds: x' = mu = x + v dt exactly
    (computed as such, not through the kernels' algebra, which equals it only up to rounding),
    std = 0 and log_prob = 0, since a deterministic step has no density. CPS's last step into
    t' = 0 also has std = 0: x' = mu and log_prob = 0 for those samples.
    """
    _check_noise_level(noise_level, kind)
    v = velocity.float()
    x = sample.float()
    if v.shape != x.shape:
        raise ValueError(f"velocity and sample must have one shape; got {tuple(v.shape)} and {tuple(x.shape)}")
    batch = x.shape[0]
    t = _per_sample(sigma, batch, x.device, "sigma")
    t_next = _per_sample(sigma_next, batch, x.device, "sigma_next")
    _check_sigmas(t, t_next)
    dt = t_next - t

    if noise_level == 0:
        mean = x + v * _batch_view(dt, x)
        std = torch.zeros_like(t)
    elif kind == "sde":
        sigma_t = sde_sigma_t(t, t_next, noise_level)
        drift_correction = _batch_view(sigma_t**2 / (2 * t), x) * (x + _batch_view(1 - t, x) * v)
        mean = x + (v + drift_correction) * _batch_view(dt, x)
        std = sigma_t * torch.sqrt(-dt)
    else:
        std = t_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - _batch_view(t, x) * v
        x1_hat = x + _batch_view(1 - t, x) * v
        # Mathematically t'^2 - std^2 = t'^2 cos^2(a pi / 2) >= 0; the clamp absorbs the rounding
        # that makes it a tiny negative number at a = 1 (sqrt would give nan).
        noise_coefficient = torch.sqrt((t_next**2 - std**2).clamp(min=0))
        mean = _batch_view(1 - t_next, x) * x0_hat + _batch_view(noise_coefficient, x) * x1_hat

    if prev_sample is None:
        if noise_level == 0:
            # No draw at all: the step is deterministic and the generator is left untouched.
            next_sample = mean.detach()
        else:
            noise = _standard_normal(x.shape, generator, x.device)
            next_sample = (mean + _batch_view(std, x) * noise).detach()
    else:
        if prev_sample.shape != x.shape:
            raise ValueError(f"prev_sample must have shape {tuple(x.shape)}; got {tuple(prev_sample.shape)}")
        next_sample = prev_sample.detach().float()

    log_prob = _gaussian_log_prob(next_sample, mean, std)
    return SDEStepOutput(next_sample, log_prob, mean, std)


# ---------------------------------------------------------------------------
# Guidance
# ---------------------------------------------------------------------------


def cfg_velocity(v_uncond: Tensor | None, v_cond: Tensor, guidance_scale: float) -> Tensor:
    """Classifier-free guidance: v = v_u + w (v_c - v_u), in float32.

    w = 1 returns v_c itself (cast to float32) rather than v_u + (v_c - v_u), which equals it
    only up to rounding; no-CFG recipes can then pass ``v_uncond=None`` and skip that forward.
    The same w must be used at rollout and when re-scoring, or the log-probs do not match.
    """
    v_c = v_cond.float()
    if guidance_scale == 1:
        return v_c
    if v_uncond is None:
        raise ValueError(f"v_uncond is required when guidance_scale != 1; got guidance_scale={guidance_scale}")
    if v_uncond.shape != v_cond.shape:
        raise ValueError(f"v_uncond and v_cond must have one shape; got {tuple(v_uncond.shape)} and {tuple(v_cond.shape)}")
    v_u = v_uncond.float()
    return v_u + guidance_scale * (v_c - v_u)


# ---------------------------------------------------------------------------
# Which steps are sampled stochastically and trained
# ---------------------------------------------------------------------------


def _check_positive_int(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int; got {value!r}")


def sde_window(
    num_steps: int, window_size: int, window_range: tuple[int, int], generator: torch.Generator | None = None
) -> range:
    """Flow-GRPO-Fast's SDE window: steps start .. start + W - 1, start uniform in [r0, r1 - W].

    W = ``window_size``, (r0, r1) = ``window_range`` with 0 <= r0 and r1 <= ``num_steps``; both
    ends of the start's interval are included, so the window always lies inside [r0, r1).
    Steps outside the window are ODE steps (noise_level 0) and are neither stored nor trained.
    Draw with a generator seeded the same way on every rank if all ranks must share a window.
    ValueError names the offending argument.
    """
    _check_positive_int(num_steps, "num_steps")
    _check_positive_int(window_size, "window_size")
    if (
        not isinstance(window_range, (tuple, list))
        or len(window_range) != 2
        or any(isinstance(r, bool) or not isinstance(r, int) for r in window_range)
    ):
        raise ValueError(f"window_range must be a pair of ints (r0, r1); got {window_range!r}")
    r0, r1 = window_range
    if not 0 <= r0 < r1 <= num_steps:
        raise ValueError(f"window_range must satisfy 0 <= r0 < r1 <= num_steps={num_steps}; got {tuple(window_range)}")
    if window_size > r1 - r0:
        raise ValueError(f"window_size={window_size} does not fit in window_range {tuple(window_range)} ({r1 - r0} steps)")
    draw_device = generator.device if generator is not None else "cpu"
    start = r0 + int(torch.randint(r1 - window_size - r0 + 1, (1,), generator=generator, device=draw_device))
    return range(start, start + window_size)


def train_timesteps(num_steps: int, timestep_fraction: float) -> range:
    """The steps trained: 0 .. int(num_steps * timestep_fraction) - 1.

    Flow-GRPO trains the first int(T f) steps; f = 0.99 with T = 10 gives steps 0..8 and skips
    the last, near-clean step (whose tiny std makes its log-ratio the noisiest). ``int`` truncates
    as the public code does, float rounding included (0.29 * 100 = 28.999... -> 28 steps).
    ValueError when fewer than one step would be trained.
    """
    _check_positive_int(num_steps, "num_steps")
    if not 0 < timestep_fraction <= 1:
        raise ValueError(f"timestep_fraction must be in (0, 1]; got {timestep_fraction}")
    count = int(num_steps * timestep_fraction)
    if count < 1:
        raise ValueError(f"timestep_fraction={timestep_fraction} trains no step of num_steps={num_steps}")
    return range(count)


# ---------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------


def shifted_sigmas(num_steps: int, shift: float, *, num_train_timesteps: int = 1000) -> Tensor:
    """The SD3 sigma schedule, float32 [num_steps + 1], equal to diffusers' FlowMatchEulerDiscreteScheduler.

    The textbook form is sigma_i = shift s_i / (1 + (shift - 1) s_i) with s = linspace(1, 0, N + 1).
    diffusers (checked against 0.42.1, static shift) differs in detail, and this matches it
    exactly, so that rollouts here and in a diffusers pipeline share their steps:
      - its grid stops at the shifted training minimum instead of 0:
        s = linspace(1, sigma_min, N) with sigma_min = shift(1 / T), T = ``num_train_timesteps``
        (the shift is then applied a second time on top of that grid);
      - a terminal sigma of exactly 0 is appended, giving N + 1 values.
    The table endpoints are computed in float32 and the grid in float64 before the final cast to
    float32, in that order, as diffusers does; sigma_0 = 1.
    """
    _check_positive_int(num_steps, "num_steps")
    _check_positive_int(num_train_timesteps, "num_train_timesteps")
    if not shift > 0:
        raise ValueError(f"shift must be > 0; got {shift}")

    def shifted(s: Tensor) -> Tensor:
        return shift * s / (1 + (shift - 1) * s)

    # diffusers' training table: timesteps 1 .. T in float32, sigma = timestep / T, shifted in float32.
    ends = torch.tensor([num_train_timesteps, 1], dtype=torch.float32) / num_train_timesteps
    sigma_max, sigma_min = shifted(ends).tolist()
    # numpy.linspace's arithmetic (start + i * step, last point set to stop), which torch.linspace
    # does not reproduce to the last float64 bit; the steps go through timestep units as in diffusers.
    start, stop = sigma_max * num_train_timesteps, sigma_min * num_train_timesteps
    grid = torch.arange(num_steps, dtype=torch.float64)
    if num_steps > 1:
        grid = grid * ((stop - start) / (num_steps - 1)) + start
        grid[-1] = stop
    else:
        grid = grid + start
    sigmas = shifted(grid / num_train_timesteps).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float32)])
