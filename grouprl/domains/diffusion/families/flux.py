"""FLUX.1 (dev and schnell): a ``FluxPipeline`` directory as a ``FlowModel``, and its tiny stand-in.

Everything goes through diffusers' own ``FluxPipeline`` (installed diffusers,
``pipelines/flux/pipeline_flux.py``), so what grouprl samples is what the pipeline samples:

* prompts: the pipeline's ``encode_prompt`` (CLIP's pooled vector, T5's tokens padded to
  ``max_sequence_length``, text position ids all zero);
* latents: kept UNPACKED, [C, h, w] with h, w = the image side / the VAE factor, in the
  sampler and the trainer (the SDE step is elementwise and its log-probability a mean
  over elements, so the layout does not matter there); ``FluxConditioning.velocity``
  packs them into 2 x 2 patches (``FluxPipeline._pack_latents``), builds the image
  position ids (``_prepare_latent_image_ids``) and unpacks the prediction
  (``_unpack_latents``);
* guidance: FLUX.1-dev is guidance-distilled (``transformer.config.guidance_embeds``):
  the guidance scale goes in as the ``guidance`` embedding, one transformer call, no
  classifier-free guidance. FLUX.1-schnell has no guidance embedding: the scale is not
  used (its pipeline runs guidance 0). The pipeline's optional true CFG
  (``true_cfg_scale`` with a negative prompt) is not supported;
* timesteps: the scheduler's (0..1000), divided by 1000 for the transformer as the
  pipeline does;
* the shift: the pipeline's sigmas ``linspace(1, 1/N, N)``, shifted by the scheduler with
  ``mu = calculate_shift(image tokens, ...)`` from the scheduler's config when it uses
  dynamic shifting (dev), else by its fixed shift (schnell: 1, no shift);
* the VAE's normalisation: latents = (VAE mean - shift_factor) * scaling_factor, as the
  base class does for any VAE with a shift factor.

A directory saved with the VAE null (``build_tiny_flux_pipeline(..., vae=False)``) works on
pixels in [-1, 1]: 3 channels, 12 packed (the transformer's ``in_channels``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from grouprl.domains.diffusion.models import FlowModel, load_pipeline, present_targets
from grouprl.domains.diffusion.pipeline import RowTensors

# Components a FluxPipeline directory must have; the VAE may be null (the pixel-space stand-in), and so may
# the IP-adapter's image encoder and feature extractor, which grouprl does not use.
_FLUX_REQUIRED = ("transformer", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

# flow_grpo's LoRA target modules for FLUX.1 (yifan123/flow_grpo scripts/train_flux.py): the double blocks'
# image and text attention projections and feed-forward layers; the "attn.to_q/k/v" names also match the
# single blocks' attention (which have no output projection of their own).
FLUX_LORA_TARGETS = (
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
)
# FluxPipeline refuses longer T5 sequences (check_inputs)
_MAX_T5_TOKENS = 512


def _pipeline_class():
    from diffusers import FluxPipeline

    return FluxPipeline


@dataclass
class FluxConditioning(RowTensors):
    """FLUX.1's conditioning (``pipeline.Conditioning``): T5 tokens, CLIP's pooled vector, text ids.

    Every prompt has the same ``max_sequence_length`` T5 tokens (the pipeline pads to it), so
    rows of different batches concatenate and ``text_ids`` (zeros [L, 3], shared by all rows)
    never depends on the prompts. ``guidance_embeds``: the transformer takes the guidance
    scale as an embedding (FLUX.1-dev); without it (schnell) the scale is not used.
    """

    embeds: torch.Tensor  # [B, L, joint_attention_dim]
    pooled: torch.Tensor  # [B, pooled_projection_dim]
    text_ids: torch.Tensor  # [L, 3]
    guidance_embeds: bool

    shared = ("text_ids",)  # one set of text position ids for every row

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
        """v [B, C, h, w] of unpacked latents [B, C, h, w] at the scheduler's ``timestep`` [B] (0..1000).

        As FluxPipeline's denoising loop: the latents packed into (h/2)(w/2) tokens of 4C
        channels with their position ids, ``timestep / 1000``, the guidance embedding
        ``guidance_scale`` per row when the transformer has one (else None), one call.
        """
        pipeline = _pipeline_class()
        if latents.ndim != 4:
            raise ValueError(f"FluxConditioning.velocity: latents must be [B, C, h, w], got {tuple(latents.shape)}")
        b, c, h, w = latents.shape
        if len(self.embeds) != b:
            raise ValueError(f"FluxConditioning.velocity: {len(self.embeds)} conditioning rows for {b} latents")
        packed = pipeline._pack_latents(latents, b, c, h, w)
        image_ids = pipeline._prepare_latent_image_ids(b, h // 2, w // 2, latents.device, self.text_ids.dtype)
        guidance = torch.full((b,), float(guidance_scale), device=latents.device, dtype=torch.float32) \
            if self.guidance_embeds else None
        out = transformer(hidden_states=packed, timestep=timestep.to(latents.device, latents.dtype) / 1000,
                          guidance=guidance, pooled_projections=self.pooled, encoder_hidden_states=self.embeds,
                          txt_ids=self.text_ids, img_ids=image_ids, return_dict=False)[0]
        # _unpack_latents takes the image size and the VAE factor; the latent size with factor 1 is the same
        return pipeline._unpack_latents(out, h, w, 1)


class FluxFlowModel(FlowModel):
    """A FLUX.1 pipeline (dev or schnell) behind ``FlowModel``; ``pipeline`` is its ``FluxPipeline``.

    Latents are [C, h, w] (C = the transformer's ``in_channels`` / 4, h = height / the VAE
    factor, even); prompts are T5 sequences of ``max_sequence_length`` tokens.
    """

    family = "flux"
    video = False

    @property
    def guidance_embeds(self) -> bool:
        """Whether the transformer takes the guidance scale as an embedding (FLUX.1-dev; not schnell)."""
        return bool(self.transformer.config.guidance_embeds)

    @property
    def default_size(self) -> int:
        """The pipeline's default image side: ``default_sample_size`` (128) latent cells x the VAE factor
        (1024 px for FLUX.1; 128 px for a pixel-space stand-in)."""
        return int(self.pipeline.default_sample_size) * self.vae_scale_factor

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(C, h, w) of a ``height`` x ``width`` image: sides multiples of 2 x the VAE factor (2 x 2 packing)."""
        if frames is not None:
            raise ValueError(f"FlowModel({self.path}): a {self.family} model makes images, not videos "
                             f"(frames {frames} given)")
        multiple = 2 * self.vae_scale_factor
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(f"FlowModel({self.path}): height and width must be positive multiples of {multiple} "
                             f"(VAE factor x 2, FLUX packs 2 x 2 latent cells), got {height} x {width}")
        return (int(self.transformer.config.in_channels) // 4, height // self.vae_scale_factor,
                width // self.vae_scale_factor)

    def image_seq_len(self, height: int, width: int) -> int:
        """The image's transformer tokens: (h / 2) (w / 2) packed latent patches."""
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)

    def schedule(self, num_steps: int, height: int, width: int, frames: int | None = None):
        """FluxPipeline's schedule: sigmas linspace(1, 1/N, N), shifted by the scheduler; with dynamic
        shifting mu = ``calculate_shift(image tokens, base_image_seq_len, max_image_seq_len, base_shift,
        max_shift)`` (the scheduler config's values, the pipeline's defaults when absent)."""
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        from grouprl.domains.diffusion.pipeline import schedule

        if frames is not None:
            self.latent_shape(height, width, frames)  # refuses frames
        scheduler = type(self.scheduler).from_config(self.scheduler.config)
        sigmas = np.linspace(1.0, 1.0 / num_steps, num_steps).tolist()
        if not getattr(scheduler.config, "use_dynamic_shifting", False):
            return schedule(scheduler, num_steps, sigmas=sigmas)
        config = scheduler.config
        mu = calculate_shift(self.image_seq_len(height, width), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return schedule(scheduler, num_steps, mu=mu, sigmas=sigmas)

    def lora_targets(self) -> list[str]:
        """flow_grpo's FLUX.1 LoRA targets (scripts/train_flux.py, ``FLUX_LORA_TARGETS``) that name some
        ``nn.Linear`` of this transformer (a one-block stand-in has them all)."""
        return present_targets(self.transformer, FLUX_LORA_TARGETS, "flow_grpo's FLUX LoRA targets")

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 tokens [B, max_sequence_length, D], CLIP pooled [B, P]): the pipeline's ``encode_prompt``."""
        embeds, pooled, _ = self._encode(prompts)
        return embeds, pooled

    def _encode(self, prompts: Sequence[str]):
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("FluxFlowModel: prompts must be a non-empty list of strings")
        embeds, pooled, text_ids = self.pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, device=self.device, num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length)
        return embeds.to(self.dtype), pooled.to(self.dtype), text_ids.to(self.dtype)

    @torch.no_grad()
    def condition(self, prompts: Sequence[str], guidance_scale: float = 1.0) -> FluxConditioning:
        """``FluxConditioning`` of ``prompts`` on the model's device. No empty-prompt rows: FLUX.1-dev's
        guidance is an embedding of the scale (given to ``velocity``), and schnell has none."""
        embeds, pooled, text_ids = self._encode(prompts)
        return FluxConditioning(embeds, pooled, text_ids, self.guidance_embeds)


def load_flux(path: Path, dtype: torch.dtype, max_sequence_length: int) -> FluxFlowModel:
    """A ``FluxPipeline`` directory as a ``FluxFlowModel`` (``models.FLOW_FAMILIES`` ``flux``).

    Prompts get ``min(max_sequence_length, the T5 tokenizer's model_max_length, 512)`` T5
    tokens: FLUX.1's tokenizer allows 512 (the pipeline's default), a tiny stand-in's as few
    as its prompts need. A directory with the VAE null works in pixel space (VAE factor 1;
    the pipeline's own factor is set to 1 too, so its ``__call__`` agrees).
    """
    pipeline = load_pipeline(path, _pipeline_class(), _FLUX_REQUIRED, dtype)
    if pipeline.vae is None:
        # FluxPipeline assumes FLUX's 8x VAE when it has none; a pixel-space model has factor 1
        pipeline.vae_scale_factor = 1
    length = min(int(max_sequence_length), int(pipeline.tokenizer_2.model_max_length), _MAX_T5_TOKENS)
    return FluxFlowModel(
        transformer=pipeline.transformer, scheduler=pipeline.scheduler, vae=pipeline.vae,
        text_encoders=[pipeline.text_encoder, pipeline.text_encoder_2],
        tokenizers=[pipeline.tokenizer, pipeline.tokenizer_2],
        path=path, pipeline=pipeline, max_sequence_length=length,
    )


# ---------------------------------------------------------------- tiny stand-in

# FLUX.1-dev's and FLUX.1-schnell's scheduler configs (scheduler/scheduler_config.json of each): dev shifts
# by the image's token count, schnell does not shift (shift 1, no dynamic shifting).
_SCHEDULERS = {
    "dev": {"shift": 3.0, "use_dynamic_shifting": True},
    "schnell": {"shift": 1.0, "use_dynamic_shifting": False},
}
_SCHEDULER_COMMON = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
                     "num_train_timesteps": 1000}
# FLUX.1's VAE normalisation (vae/config.json), so decode/encode exercise the shift as well as the scale
_VAE_SCALING, _VAE_SHIFT = 0.3611, 0.1159


def rope_axes(attention_head_dim: int) -> tuple[int, int, int]:
    """The rotary embedding's split of a head over (text/index, row, column) position ids, even parts
    summing to ``attention_head_dim``, in FLUX.1's proportions (16, 56, 56) of 128:
    first = max(2, 2 round(d / 16)), the rest halved (the row part rounded down to even)."""
    if attention_head_dim < 6 or attention_head_dim % 2:
        raise ValueError(f"rope_axes: attention_head_dim must be even and >= 6, got {attention_head_dim}")
    first = max(2, 2 * round(attention_head_dim / 16))
    rest = attention_head_dim - first
    row = 2 * (rest // 4)
    return first, row, rest - row


def _clip_text_model(tokenizer, *, seed: int, hidden_size: int, layers: int, heads: int):
    # FLUX reads CLIPTextModel's pooled output (the EOS state), not a projection
    from transformers import CLIPTextConfig, CLIPTextModel

    from grouprl.domains.diffusion.tiny import _seeded

    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=tokenizer.model_max_length,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return _seeded(seed, lambda: CLIPTextModel(config).eval())


def build_tiny_flux_pipeline(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vae: bool = True,
    variant: str = "dev",
    image_size: int = 16,
    corpus: Sequence[str] | None = None,
    num_layers: int = 1,
    num_single_layers: int = 1,
    num_attention_heads: int = 2,
    attention_head_dim: int = 8,
    embed_dim: int = 16,
    text_layers: int = 1,
    max_prompt_tokens: int = 12,
    vae_blocks: int = 2,
) -> Path:
    """Build a randomly initialised ``FluxPipeline`` and ``save_pretrained`` it to ``out_dir``.

    The real classes at tiny sizes: a ``FluxTransformer2DModel`` of ``num_layers`` double and
    ``num_single_layers`` single blocks (heads x ``attention_head_dim``, rotary axes
    ``rope_axes``), a ``CLIPTextModel`` (pooled vector, width ``embed_dim``) and a
    ``T5EncoderModel`` (tokens, width ``embed_dim``) with tokenizers built from ``corpus``
    (default: the shapes task's prompts) cut at ``max_prompt_tokens``, and FLUX.1's
    scheduler config for ``variant``: ``dev`` (guidance embedding, dynamic shift) or
    ``schnell`` (neither).

    ``vae=True``: an ``AutoencoderKL`` of ``vae_blocks`` blocks (factor 2 ** (blocks - 1)) with
    4 latent channels and FLUX.1's scale and shift; the transformer takes 16 packed channels.
    ``vae=False``: no VAE (saved null), the transformer works on RGB pixels, 12 packed channels:
    the CPU demo's model. ``image_size`` is the pixel side the stand-in is meant for (the VAE's
    ``sample_size``); it must be a multiple of 2 x the VAE factor.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from grouprl.domains.diffusion import shapes
    from grouprl.domains.diffusion.tiny import _seeded, _t5_encoder, build_clip_tokenizer, build_t5_tokenizer
    from grouprl.files import follow_umask

    if variant not in _SCHEDULERS:
        raise ValueError(f"build_tiny_flux_pipeline: variant must be one of {sorted(_SCHEDULERS)}, got {variant!r}")
    if vae_blocks < 1:
        raise ValueError(f"build_tiny_flux_pipeline: vae_blocks must be >= 1, got {vae_blocks}")
    factor = 2 ** (vae_blocks - 1) if vae else 1
    if image_size <= 0 or image_size % (2 * factor):
        raise ValueError(f"build_tiny_flux_pipeline: image_size must be a positive multiple of {2 * factor} "
                         f"(2 x the VAE factor), got {image_size}")
    out_dir = Path(out_dir)
    corpus = list(corpus) if corpus is not None else shapes.corpus()
    channels = 4 if vae else 3
    transformer = _seeded(seed, lambda: FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * channels,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads,
        joint_attention_dim=embed_dim,
        pooled_projection_dim=embed_dim,
        guidance_embeds=variant == "dev",
        axes_dims_rope=rope_axes(attention_head_dim),
    ))
    autoencoder = None
    if vae:
        autoencoder = _seeded(seed + 1, lambda: AutoencoderKL(
            in_channels=3, out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * vae_blocks, up_block_types=("UpDecoderBlock2D",) * vae_blocks,
            block_out_channels=(4,) * vae_blocks, layers_per_block=1, latent_channels=channels, norm_num_groups=1,
            sample_size=image_size, scaling_factor=_VAE_SCALING, shift_factor=_VAE_SHIFT,
            use_quant_conv=False, use_post_quant_conv=False,
        ))
    clip_tokenizer = build_clip_tokenizer(corpus, model_max_length=max_prompt_tokens)
    t5_tokenizer = build_t5_tokenizer(corpus, model_max_length=max_prompt_tokens)
    pipeline = _pipeline_class()(
        scheduler=FlowMatchEulerDiscreteScheduler(**_SCHEDULER_COMMON, **_SCHEDULERS[variant]),
        vae=autoencoder,
        text_encoder=_clip_text_model(clip_tokenizer, seed=seed + 2, hidden_size=embed_dim, layers=text_layers,
                                      heads=2),
        tokenizer=clip_tokenizer,
        text_encoder_2=_t5_encoder(t5_tokenizer, seed=seed + 3, hidden_size=embed_dim, layers=text_layers, heads=2),
        tokenizer_2=t5_tokenizer,
        transformer=transformer,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir
