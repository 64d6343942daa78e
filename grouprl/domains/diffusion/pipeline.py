"""The pipeline: runs a flow model and the step math over a whole denoising trajectory.

diffusers' split: the model (``models.FlowModel``: transformer, text encoders, VAE),
the scheduler math (``scheduler.sde_step``, a pure function) and this loop, which
calls the transformer once per step (twice in one batch with classifier-free
guidance) and hands the velocity to the step math. The schedule itself (sigmas and
the transformer's timesteps) comes from the model's own diffusers scheduler.

Which steps are SDE steps (noise, a log-probability) and which are ODE steps is the
caller's choice: Flow-GRPO makes every step an SDE step, Flow-GRPO-Fast only a
window of them, validation none. Only the steps in ``store`` are kept for training:
the sample before the step, the sample after it, its log-probability under the
sampling weights and its mean (GRPO-Guard's RatioNorm needs the old means).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch

from grouprl.domains.diffusion.scheduler import cfg_velocity, sde_step


@dataclass
class Schedule:
    """``sigmas`` [N+1] from 1 towards 0 (the last is 0) and the transformer's ``timesteps`` [N]."""

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)


def schedule(scheduler, num_steps: int, *, mu: float | None = None, sigmas=None) -> Schedule:
    """The model's own schedule for ``num_steps`` steps (a diffusers ``FlowMatchEulerDiscreteScheduler``).

    ``mu`` is the resolution-dependent shift of a scheduler with ``use_dynamic_shifting``
    (FLUX.1, Qwen-Image: the family computes it from the image's token count with
    diffusers' ``calculate_shift``, as its pipeline does); such a scheduler gets the
    pipeline's sigmas ``linspace(1, 1/N, N)``, shifted by the scheduler itself. A
    fixed-shift scheduler (SD3, SD3.5) takes no ``mu``. ``sigmas`` (N values, before the
    shift) are the unshifted sigmas a family's pipeline passes to the scheduler where they
    differ from the default (FLUX.1-schnell: a fixed shift, but FluxPipeline's
    ``linspace(1, 1/N, N)`` instead of the scheduler's own spacing).
    """
    dynamic = bool(getattr(scheduler.config, "use_dynamic_shifting", False))
    if dynamic and mu is None:
        # the shift depends on the image size: the model's family computes mu (FlowModel.schedule)
        raise ValueError("the model's scheduler uses dynamic shifting (a resolution-dependent shift): its mu must be "
                         "given (FlowModel.schedule computes it for the families that use it)")
    if dynamic:
        import numpy as np

        scheduler.set_timesteps(num_steps, device="cpu", mu=mu, sigmas=list(sigmas) if sigmas is not None else
                                np.linspace(1.0, 1.0 / num_steps, num_steps).tolist())
    else:
        if mu is not None:
            raise ValueError(f"mu {mu} given for a scheduler without dynamic shifting (a fixed shift)")
        scheduler.set_timesteps(num_steps, device="cpu", sigmas=None if sigmas is None else list(sigmas))
    sigmas = scheduler.sigmas.detach().to(torch.float32).clone()
    timesteps = scheduler.timesteps.detach().to(torch.float32).clone()
    if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"the scheduler gave {len(sigmas)} sigmas ending at {float(sigmas[-1])} for {num_steps} steps; "
                         "expected num_steps + 1 ending at 0")
    return Schedule(sigmas=sigmas, timesteps=timesteps)


class Conditioning(Protocol):
    """A batch of rows' text conditioning in a model family's form, and how its transformer is called.

    ``FlowModel.condition`` makes one (with the empty prompt's too when guidance needs
    it); ``PromptEmbeddings`` is SD3's. Everything the family's transformer needs besides
    the latents and the timestep (pooled vectors, masks, position ids, a guidance
    embedding) lives here, so the sampler, the trainer and pretraining call any family
    the same way: ``text.velocity(transformer, latents, timestep, guidance_scale)``.
    Latents are in the family's unpacked latent layout (``FlowModel.latent_shape``);
    a family that packs them into tokens packs and unpacks inside ``velocity``.
    """

    def select(self, rows) -> "Conditioning":
        """The rows ``rows`` (an index tensor or list), repeated rows allowed."""

    def to(self, device) -> "Conditioning":
        """The same conditioning on ``device``."""

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
        """The velocity v = eps - x0 [B, *latent] at the scheduler's ``timestep`` [B] (0..1000)."""


class RowTensors:
    """``select`` and ``to`` for a conditioning dataclass: its tensor fields hold a row per sample (a field
    may be None: guidance off), except those named in ``shared``, the same for every row (moved, not
    indexed); other fields (flags) are kept as they are."""

    shared: ClassVar[tuple[str, ...]] = ()

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def select(self, rows):
        return dataclasses.replace(self, **{name: value[rows] for name, value in self._tensors().items()
                                            if name not in self.shared})

    def to(self, device):
        return dataclasses.replace(self, **{name: value.to(device) for name, value in self._tensors().items()})


@dataclass
class PromptEmbeddings(RowTensors):
    """SD3's conditioning (``Conditioning``): text tokens and the pooled vector, with the empty prompt's for guidance."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]
    negative_embeds: torch.Tensor | None = None  # [B, L, D]; None when guidance is off
    negative_pooled: torch.Tensor | None = None

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
        """v = v_u + w (v_c - v_u): one SD3 transformer call on 2B rows with guidance (the empty prompt's first)."""
        if guidance_scale == 1.0:
            return transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=self.embeds,
                               pooled_projections=self.pooled, return_dict=False)[0]
        if self.negative_embeds is None:
            raise ValueError(f"guidance_scale {guidance_scale} needs the empty prompt's embeddings (encode with "
                             "guidance)")
        both = transformer(hidden_states=torch.cat([latents, latents]), timestep=torch.cat([timestep, timestep]),
                           encoder_hidden_states=torch.cat([self.negative_embeds, self.embeds]),
                           pooled_projections=torch.cat([self.negative_pooled, self.pooled]), return_dict=False)[0]
        uncond, cond = both.chunk(2)
        return cfg_velocity(uncond, cond, guidance_scale)


def encode(model, prompts: list[str], guidance_scale: float) -> Conditioning:
    """The conditioning of ``prompts`` (and of the empty prompt when guidance is on): ``model.condition``."""
    return model.condition(prompts, guidance_scale)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, text: Conditioning,
             guidance_scale: float) -> torch.Tensor:
    """The guided velocity at ``timestep`` [B], as ``text``'s family calls its transformer (``Conditioning``)."""
    return text.velocity(transformer, latents, timestep, guidance_scale)


@dataclass
class Trajectory:
    """One sampler call: the final samples and, for each stored step, what training re-scores.

    ``steps`` are the stored step indices (the same for every row); the per-step tensors
    are stacked on dim 1 in that order.
    """

    final: torch.Tensor  # [B, *latent] ([C, H, W]; video [C, F, H, W]): the clean sample (latents, or pixels)
    steps: list[int]
    latents: torch.Tensor  # [B, S, *latent], the sample before each stored step
    next_latents: torch.Tensor  # [B, S, *latent], the sample after it
    log_probs: torch.Tensor  # [B, S], under the weights that sampled
    means: torch.Tensor  # [B, S, *latent]


@torch.no_grad()
def sample(transformer, text: Conditioning, noise: torch.Tensor, sched: Schedule, *, guidance_scale: float,
           noise_level: float, kind: str = "sde", sde_steps=(), store=(), generator: torch.Generator | None = None,
           input_dtype: torch.dtype | None = None) -> Trajectory:
    """Denoise ``noise`` [B, *latent] over ``sched``: SDE steps at ``sde_steps`` (else Euler ODE steps).

    The steps in ``store`` (a subset of ``sde_steps``) keep their inputs, outputs,
    log-probabilities and means. Computed in fp32; the transformer gets its input in
    ``input_dtype`` (default: the dtype of its first parameter). A trainer that re-scores
    the stored steps must call the transformer the same way (input dtype and autocast
    context), or the first ratio of an update is not 1.
    """
    sde_steps, store = set(sde_steps), sorted(set(store))
    if not set(store) <= sde_steps:
        raise ValueError(f"stored steps {sorted(set(store) - sde_steps)} are not SDE steps; only SDE steps have a log-prob")
    dtype = input_dtype if input_dtype is not None else next(transformer.parameters()).dtype
    x = noise.to(torch.float32)
    kept: dict[str, list[torch.Tensor]] = {"latents": [], "next_latents": [], "log_probs": [], "means": []}
    for i in range(sched.num_steps):
        timestep = sched.timesteps[i].expand(len(x)).to(x.device)
        v = velocity(transformer, x.to(dtype), timestep, text, guidance_scale).to(torch.float32)
        out = sde_step(v, x, float(sched.sigmas[i]), float(sched.sigmas[i + 1]),
                       noise_level=noise_level if i in sde_steps else 0.0, kind=kind, generator=generator)
        if i in store:
            kept["latents"].append(x)
            kept["next_latents"].append(out.prev_sample)
            kept["log_probs"].append(out.log_prob)
            kept["means"].append(out.mean)
        x = out.prev_sample
    b = len(x)
    stack = {k: torch.stack(v, dim=1) if v else torch.empty(b, 0, *(() if k == "log_probs" else x.shape[1:]))
             for k, v in kept.items()}
    return Trajectory(final=x, steps=store, **stack)
