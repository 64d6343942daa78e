"""Rectified-flow pretraining of a flow model's transformer, and a plain Euler ODE sampler.

The CPU demo starts from a randomly initialised model, so before RL it needs a model
that roughly follows prompts: ``pretrain_flow`` fits the transformer to (image,
prompt) pairs with the rectified-flow loss, and ``sample_ode`` draws images from it
deterministically for evaluation. The RL sampler, with SDE steps and log-probabilities,
lives elsewhere; this one only integrates the ODE.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from PIL import Image

from grouprl.domains.diffusion.models import FlowModel

TIMESTEP_SAMPLING = ("logit_normal", "uniform")
LR_SCHEDULES = ("constant", "cosine")


def predict_velocity(model: FlowModel, latents: torch.Tensor, sigma: torch.Tensor | float, text,
                     guidance_scale: float = 1.0) -> torch.Tensor:
    """The transformer's velocity (eps - x0) at noise level ``sigma`` in [0, 1] (a float or one per sample).

    ``text`` is the rows' conditioning (``model.condition``), which calls the family's
    transformer; it gets the timestep ``sigma * num_train_timesteps``, the scale of the
    scheduler's timesteps.
    """
    scale = float(model.scheduler.config.num_train_timesteps)
    sigma = torch.as_tensor(sigma, dtype=latents.dtype, device=latents.device)
    timestep = (sigma * scale).expand(latents.shape[0]) if sigma.ndim == 0 else sigma * scale
    return text.velocity(model.transformer, latents, timestep, guidance_scale)


def _sample_t(kind: str, n: int, generator: torch.Generator) -> torch.Tensor:
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    # SD3's logit-normal (mean 0, std 1): most samples at mid noise, where the
    # velocity is hardest to predict, few at the nearly trivial ends.
    return torch.sigmoid(torch.randn(n, generator=generator))


def pretrain_flow(
    model: FlowModel,
    images_and_prompts: Sequence[tuple[Image.Image, str]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    prompt_dropout: float = 0.1,
    timestep_sampling: str = "logit_normal",
    weight_decay: float = 0.0,
    warmup_steps: int = 0,
    lr_schedule: str = "constant",
    max_grad_norm: float | None = 1.0,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train ``model.transformer`` with the rectified-flow loss; returns the loss of every step.

    Per step: a batch of pairs (drawn with replacement), t from ``timestep_sampling``,
    eps ~ N(0, I), x_t = (1 - t) x0 + t eps, loss = MSE(v(x_t, t, prompt), eps - x0).
    Each prompt is replaced by the model's unconditional prompt (``negative_prompt``, the empty
    one but for Qwen-Image's " ") with probability ``prompt_dropout``,
    so the same model also predicts unconditionally (the other half of CFG). The text
    encoders and the VAE stay frozen: prompts and images are encoded once up front.
    AdamW over the transformer's trainable parameters in fp32, with ``warmup_steps`` of
    linear warm-up and then a ``constant`` or ``cosine`` (to zero) learning rate;
    gradients clipped to ``max_grad_norm`` (None: not clipped). ``on_step(step, loss)``
    is called after every step. Deterministic in ``seed``.
    """
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise ValueError(f"pretrain_flow: steps, batch_size and lr must be positive, got {steps}, {batch_size}, {lr}")
    if timestep_sampling not in TIMESTEP_SAMPLING:
        raise ValueError(f"pretrain_flow: timestep_sampling must be one of {TIMESTEP_SAMPLING}, "
                         f"got {timestep_sampling!r}")
    if lr_schedule not in LR_SCHEDULES:
        raise ValueError(f"pretrain_flow: lr_schedule must be one of {LR_SCHEDULES}, got {lr_schedule!r}")
    if not 0.0 <= prompt_dropout <= 1.0:
        raise ValueError(f"pretrain_flow: prompt_dropout must be in [0, 1], got {prompt_dropout}")
    if model.dtype != torch.float32:
        raise ValueError(f"pretrain_flow: the transformer must be float32 (load with dtype=torch.float32), "
                         f"got {model.dtype}")
    pairs = list(images_and_prompts)
    if not pairs:
        raise ValueError("pretrain_flow: images_and_prompts is empty")
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    if not params:
        raise ValueError("pretrain_flow: the transformer has no trainable parameters")

    device = model.device
    x0_all = torch.cat([model.encode_images([image for image, _ in pairs[i:i + 256]])
                        for i in range(0, len(pairs), 256)])
    unique = list(dict.fromkeys(prompt for _, prompt in pairs))
    text = model.condition(unique + [model.negative_prompt])  # the last row is the unconditional prompt
    prompt_row = {prompt: i for i, prompt in enumerate(unique)}
    rows = torch.tensor([prompt_row[prompt] for _, prompt in pairs], device=device)
    empty_row = len(unique)

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if lr_schedule == "cosine":
            progress = (step - warmup_steps) / max(1, steps - warmup_steps)
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    losses: list[float] = []
    model.transformer.train()
    try:
        for step in range(steps):
            index = torch.randint(len(pairs), (batch_size,), generator=generator).to(device)
            dropped = (torch.rand(batch_size, generator=generator) < prompt_dropout).to(device)
            batch_rows = torch.where(dropped, torch.full_like(rows[index], empty_row), rows[index])
            x0 = x0_all[index]
            t = _sample_t(timestep_sampling, batch_size, generator).to(device)
            eps = torch.randn(x0.shape, generator=generator).to(device)
            t_ = t.view(-1, *([1] * (x0.ndim - 1)))
            x_t = (1 - t_) * x0 + t_ * eps
            v = predict_velocity(model, x_t, t, text.select(batch_rows))
            loss = torch.nn.functional.mse_loss(v.float(), (eps - x0).float())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            scheduler.step()
            losses.append(float(loss.detach()))
            if on_step is not None:
                on_step(step, losses[-1])
    finally:
        model.transformer.eval()
    return losses


@torch.no_grad()
def sample_ode(
    model: FlowModel,
    prompts: Sequence[str],
    *,
    num_steps: int = 20,
    guidance_scale: float = 1.0,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    height: int | None = None,
    width: int | None = None,
    batch_size: int = 64,
) -> list[Image.Image]:
    """Images for ``prompts`` by Euler steps x <- x + (sigma_next - sigma) v along the scheduler's sigmas.

    With ``guidance_scale`` != 1, v = v_uncond + w (v_cond - v_uncond), the unconditional
    velocity taken with the empty prompt. Noise comes from ``generator`` (a CPU
    generator), else from a new one seeded with ``seed``, else from torch's global RNG;
    it is drawn for all prompts up front, so a prompt's image does not depend on
    ``batch_size``. Height and width default to the model's ``default_size``.
    """
    prompts = list(prompts)
    if not prompts:
        return []
    if num_steps < 1:
        raise ValueError(f"sample_ode: num_steps must be >= 1, got {num_steps}")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    height = height or model.default_size
    width = width or model.default_size
    shape = model.latent_shape(height, width)
    device = model.device
    noise = torch.randn((len(prompts), *shape), generator=generator, dtype=torch.float32)
    sigmas = model.schedule(num_steps, height, width).sigmas.to(device)
    images: list[Image.Image] = []
    was_training = model.transformer.training
    model.transformer.eval()
    try:
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            text = model.condition(chunk, guidance_scale)
            x = noise[start:start + len(chunk)].to(device, model.dtype)
            for i in range(num_steps):
                v = predict_velocity(model, x, sigmas[i], text, guidance_scale).float()
                x = (x.float() + (sigmas[i + 1] - sigmas[i]) * v).to(model.dtype)
            images += model.decode(x)
    finally:
        model.transformer.train(was_training)
    return images
