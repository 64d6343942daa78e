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

from dataclasses import dataclass

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


def schedule(scheduler, num_steps: int) -> Schedule:
    """The model's own schedule for ``num_steps`` steps (a diffusers ``FlowMatchEulerDiscreteScheduler``)."""
    if getattr(scheduler.config, "use_dynamic_shifting", False):
        # the shift would depend on the image size (FLUX-style mu); SD3/SD3.5 use a fixed shift
        raise ValueError("the model's scheduler uses dynamic shifting, which the flow trainer does not support; "
                         "use a scheduler with use_dynamic_shifting: false (SD3 / SD3.5)")
    scheduler.set_timesteps(num_steps, device="cpu")
    sigmas = scheduler.sigmas.detach().to(torch.float32).clone()
    timesteps = scheduler.timesteps.detach().to(torch.float32).clone()
    if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0:
        raise ValueError(f"the scheduler gave {len(sigmas)} sigmas ending at {float(sigmas[-1])} for {num_steps} steps; "
                         "expected num_steps + 1 ending at 0")
    return Schedule(sigmas=sigmas, timesteps=timesteps)


@dataclass
class PromptEmbeddings:
    """Text conditioning for a batch of rows, with the empty prompt's for guidance."""

    embeds: torch.Tensor  # [B, L, D]
    pooled: torch.Tensor  # [B, P]
    negative_embeds: torch.Tensor | None = None  # [B, L, D]; None when guidance is off
    negative_pooled: torch.Tensor | None = None

    def select(self, rows) -> "PromptEmbeddings":
        pick = (lambda t: None if t is None else t[rows])  # noqa: E731
        return PromptEmbeddings(pick(self.embeds), pick(self.pooled), pick(self.negative_embeds),
                                pick(self.negative_pooled))


def encode(model, prompts: list[str], guidance_scale: float) -> PromptEmbeddings:
    """Encode ``prompts`` (and the empty prompt when guidance is on) with the model's text encoders."""
    with torch.no_grad():
        embeds, pooled = model.encode_prompts(prompts)
        if guidance_scale == 1.0:
            return PromptEmbeddings(embeds, pooled)
        negative, negative_pooled = model.encode_prompts([""] * len(prompts))
    return PromptEmbeddings(embeds, pooled, negative, negative_pooled)


def velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, text: PromptEmbeddings,
             guidance_scale: float) -> torch.Tensor:
    """The guided velocity v = v_u + w (v_c - v_u) at ``timestep`` [B]; one transformer call on 2B rows with guidance."""
    if guidance_scale == 1.0:
        return transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=text.embeds,
                           pooled_projections=text.pooled, return_dict=False)[0]
    if text.negative_embeds is None:
        raise ValueError(f"guidance_scale {guidance_scale} needs the empty prompt's embeddings (encode with guidance)")
    both = transformer(hidden_states=torch.cat([latents, latents]), timestep=torch.cat([timestep, timestep]),
                       encoder_hidden_states=torch.cat([text.negative_embeds, text.embeds]),
                       pooled_projections=torch.cat([text.negative_pooled, text.pooled]), return_dict=False)[0]
    uncond, cond = both.chunk(2)
    return cfg_velocity(uncond, cond, guidance_scale)


@dataclass
class Trajectory:
    """One sampler call: the final samples and, for each stored step, what training re-scores.

    ``steps`` are the stored step indices (the same for every row); the per-step tensors
    are stacked on dim 1 in that order.
    """

    final: torch.Tensor  # [B, C, H, W], the clean sample (latents, or pixels in [-1, 1])
    steps: list[int]
    latents: torch.Tensor  # [B, S, C, H, W], the sample before each stored step
    next_latents: torch.Tensor  # [B, S, C, H, W], the sample after it
    log_probs: torch.Tensor  # [B, S], under the weights that sampled
    means: torch.Tensor  # [B, S, C, H, W]


@torch.no_grad()
def sample(transformer, text: PromptEmbeddings, noise: torch.Tensor, sched: Schedule, *, guidance_scale: float,
           noise_level: float, kind: str = "sde", sde_steps=(), store=(), generator: torch.Generator | None = None,
           input_dtype: torch.dtype | None = None) -> Trajectory:
    """Denoise ``noise`` [B, C, H, W] over ``sched``: SDE steps at ``sde_steps`` (else Euler ODE steps).

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
