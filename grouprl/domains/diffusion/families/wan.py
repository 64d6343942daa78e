"""Wan 2.x text-to-video (diffusers' ``WanPipeline``) as a flow model family, and its tiny stand-in.

What loads: a ``WanPipeline`` directory (``model_index.json``), through the pipeline's own
``from_pretrained``; ``models.load_flow_model`` picks this family by the pipeline class. The
parts are the pipeline's: a UMT5 text encoder with its T5 tokenizer, ``WanTransformer3DModel``
on latents ``[B, C, F, H, W]``, ``AutoencoderKLWan`` (or none: a pixel-space stand-in saved
with the VAE null) and the scheduler. Two-expert Wan 2.2 (``transformer_2`` with a
``boundary_ratio``, A14B) is refused: LoRA would have to train two transformers.

How each part follows the pipeline (diffusers/pipelines/wan/pipeline_wan.py):

* text: ``WanPipeline.encode_prompt`` with ``max_sequence_length`` tokens; the pipeline zeroes
  the embeddings past each prompt's length and pads every prompt to that length, so
  conditionings of any batches concatenate. Guidance is classifier-free with the negative
  prompt "" (the pipeline's default, and flow_grpo's ``neg_prompt_embed``), on when
  ``guidance_scale > 1`` as in the pipeline: v = v_u + w (v_c - v_u), the conditional and
  unconditional velocities from two transformer calls, as the pipeline makes them;
* latents stay unpacked: the transformer patchifies them itself; its timestep is the
  scheduler's (0..1000, not divided), per token with ``expand_timesteps`` (Wan 2.2 TI2V-5B),
  as the pipeline builds it;
* frames: ``(num_frames - 1) // scale_factor_temporal + 1`` latent frames, num_frames - 1 a
  multiple of the VAE's temporal factor (the pipeline rounds other counts; here they are refused);
* the schedule: flow_grpo's Wan script (scripts/train_wan2_1.py with
  flow_grpo/diffusers_patch/wan_pipeline_with_logprob.py) keeps the model's own scheduler,
  which for Wan is ``UniPCMultistepScheduler`` with ``use_flow_sigmas`` and ``flow_shift``,
  calls its ``set_timesteps`` and steps Euler / the SDE over its ``sigmas`` and ``timesteps``
  (UniPC's solver itself is never used). ``WanFlowModel.schedule`` does the same
  (``pipeline.schedule`` on a fresh copy); a ``FlowMatchEulerDiscreteScheduler`` (what the
  pipeline's signature names and diffusers' own Wan tests use, shift = flow_shift) works too.
  Wan's shift is fixed, so the size does not enter;
* the VAE: decoding un-normalises as the pipeline does, ``z / (1 / latents_std) + latents_mean``
  per channel, and the frames come out through the pipeline's ``video_processor``;
  encoding takes the latent distribution's mode and normalises the other way,
  ``(z - latents_mean) * (1 / latents_std)``, as diffusers' Wan image-to-video pipeline does.

LoRA targets: flow_grpo's Wan script (scripts/train_wan2_1.py) lists ``to_q``, ``to_k``,
``to_v``, ``to_out.0``, ``add_q_proj``, ``add_k_proj``, ``add_v_proj``, ``to_add_out``
(rank 32, alpha 64); a text-to-video Wan has the first four, in both its self-attention
(``attn1``) and its cross-attention (``attn2``) of every block, and ``lora_targets`` returns
the names present.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image

from grouprl.domains.diffusion.models import FlowModel, load_pipeline, present_targets
from grouprl.domains.diffusion.pipeline import RowTensors

# the components a WanPipeline directory must have (the VAE may be null: a pixel-space stand-in)
_WAN_REQUIRED = ("transformer", "scheduler", "text_encoder", "tokenizer")
# flow_grpo's LoRA target modules for Wan (scripts/train_wan2_1.py)
WAN_LORA_TARGETS = ("add_k_proj", "add_q_proj", "add_v_proj", "to_add_out", "to_k", "to_out.0", "to_q", "to_v")
# the pixel side of the pixel-space stand-in (no VAE, so no pipeline default applies)
TINY_PIXEL_SIZE = 16


@dataclass
class WanConditioning(RowTensors):
    """Wan's conditioning (``pipeline.Conditioning``): UMT5 token embeddings padded to
    ``max_sequence_length``, and the negative prompt's for guidance."""

    embeds: torch.Tensor  # [B, L, D]
    negative_embeds: torch.Tensor | None = None  # [B, L, D]; None when guidance is off
    # Wan 2.2 TI2V: the transformer takes a timestep per latent token (the pipeline's expand_timesteps)
    expand_timesteps: bool = False

    def _timestep(self, transformer, latents: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        if not self.expand_timesteps:
            return timestep
        # one timestep per latent token after the transformer's patching, as WanPipeline builds it
        patch = _transformer_config(transformer).patch_size
        tokens = (latents.shape[2] // patch[0]) * (latents.shape[3] // patch[1]) * (latents.shape[4] // patch[2])
        return timestep[:, None].expand(len(timestep), tokens)

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
        """v = v_u + w (v_c - v_u) with ``guidance_scale`` w > 1 (two transformer calls, the conditional
        first, as WanPipeline); the conditional velocity alone otherwise."""
        timestep = self._timestep(transformer, latents, timestep)
        cond = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=self.embeds,
                           return_dict=False)[0]
        if not guidance_scale > 1.0:
            return cond
        if self.negative_embeds is None:
            raise ValueError(f"guidance_scale {guidance_scale} needs the negative prompt's embeddings (condition with "
                             "guidance)")
        uncond = transformer(hidden_states=latents, timestep=timestep, encoder_hidden_states=self.negative_embeds,
                             return_dict=False)[0]
        return uncond + guidance_scale * (cond - uncond)


def _transformer_config(transformer):
    # the wrapped model's config through a PEFT wrapper
    base = transformer.get_base_model() if hasattr(transformer, "get_base_model") else transformer
    return base.config


@dataclass
class WanFlowModel(FlowModel):
    """A ``WanPipeline``'s parts behind ``FlowModel`` (see the module docstring): latents
    ``[C, F, H, W]``, ``decode`` gives each sample's frames."""

    family = "wan"
    video = True

    # ------------------------------------------------------------ geometry

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side (the VAE's ``scale_factor_spatial``; 1 in pixel space)."""
        return 1 if self.vae is None else int(self.vae.config.scale_factor_spatial)

    @property
    def vae_scale_factor_temporal(self) -> int:
        """Frames per latent frame after the first (the VAE's ``scale_factor_temporal``; 1 in pixel space)."""
        return 1 if self.vae is None else int(self.vae.config.scale_factor_temporal)

    @property
    def default_size(self) -> int:
        """The side WanPipeline generates by default (its ``height``, 480) with a VAE; ``TINY_PIXEL_SIZE``
        for the pixel-space stand-in, which no pipeline default fits."""
        if self.vae is None:
            return TINY_PIXEL_SIZE
        from diffusers import WanPipeline

        return int(inspect.signature(WanPipeline.__call__).parameters["height"].default)

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(channels, latent frames, h, w) of a ``frames``-frame video of ``height`` x ``width``:
        ``(frames - 1) // t + 1`` latent frames for the VAE's temporal factor t, frames - 1 a multiple of t."""
        if frames is None:
            raise ValueError(f"WanFlowModel({self.path}): a text-to-video model needs the number of frames "
                             "(worker.rollout.num_frames)")
        temporal = self.vae_scale_factor_temporal
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or (frames - 1) % temporal:
            raise ValueError(f"WanFlowModel({self.path}): frames must be a positive integer with frames - 1 divisible "
                             f"by the VAE's temporal factor {temporal} (e.g. {4 * temporal + 1}), got {frames!r}")
        patch = self.transformer.config.patch_size
        multiple = self.vae_scale_factor * int(patch[1])
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(f"WanFlowModel({self.path}): height and width must be positive multiples of "
                             f"{multiple} (VAE factor x patch size), got {height} x {width}")
        factor = self.vae_scale_factor
        return (int(self.transformer.config.in_channels), (frames - 1) // temporal + 1, height // factor,
                width // factor)

    def schedule(self, num_steps: int, height: int, width: int, frames: int | None = None):
        """The sigmas and timesteps of the model's own scheduler for ``num_steps`` steps, from a fresh copy
        (flow_grpo's Wan script: a UniPC scheduler's flow sigmas, stepped by Euler / the SDE; see the module
        docstring). Wan's shift is fixed: the size does not enter."""
        from grouprl.domains.diffusion.pipeline import schedule

        config = self.scheduler.config
        flow = type(self.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" or (
            getattr(config, "use_flow_sigmas", False) and getattr(config, "prediction_type", None) == "flow_prediction")
        if not flow:
            raise ValueError(f"WanFlowModel({self.path}): the scheduler {type(self.scheduler).__name__} has no flow "
                             "sigmas (a FlowMatchEulerDiscreteScheduler, or one with use_flow_sigmas and "
                             "prediction_type flow_prediction, as Wan's UniPCMultistepScheduler)")
        return schedule(type(self.scheduler).from_config(config), num_steps)

    def lora_targets(self) -> list[str]:
        """``WAN_LORA_TARGETS`` (flow_grpo's scripts/train_wan2_1.py) that name some ``nn.Linear`` of the
        transformer: ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` for text-to-video Wan."""
        return present_targets(self.transformer, WAN_LORA_TARGETS, "flow_grpo's Wan LoRA targets")

    # ------------------------------------------------------------ text

    @torch.no_grad()
    def condition(self, prompts: Sequence[str], guidance_scale: float = 1.0) -> WanConditioning:
        """``WanConditioning`` of ``prompts`` through ``WanPipeline.encode_prompt`` (with the negative prompt ""
        when ``guidance_scale > 1``), on the model's device in its dtype."""
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("WanFlowModel.condition: prompts must be a non-empty list of strings")
        guided = guidance_scale > 1.0
        embeds, negative = self.pipeline.encode_prompt(
            prompt=prompts, negative_prompt=None, do_classifier_free_guidance=guided,
            max_sequence_length=self.max_sequence_length, device=self.device, dtype=self.dtype)
        return WanConditioning(embeds, negative if guided else None,
                               expand_timesteps=bool(self.pipeline.config.get("expand_timesteps", False)))

    def encode_prompts(self, prompts: Sequence[str]):
        raise TypeError("WanFlowModel has no pooled prompt embeddings: use condition(prompts, guidance_scale)")

    # ------------------------------------------------------------ videos

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[list[Image.Image]]:
        """Each sample's frames (RGB images) from latents [B, C, F, H, W]: through the VAE, un-normalised as
        WanPipeline does, or read as pixels in [-1, 1]; the pipeline's ``video_processor`` makes the images."""
        if latents.dim() != 5:
            raise ValueError(f"WanFlowModel.decode: latents must be [B, C, F, H, W], got shape {tuple(latents.shape)}")
        x = latents.to(self.device)
        if self.vae is not None:
            mean, inverse_std = self._latent_stats(x)
            x = x.to(self.vae.dtype) / inverse_std + mean
            x = self.vae.decode(x, return_dict=False)[0]
        return self.pipeline.video_processor.postprocess_video(x.float(), output_type="pil")

    @torch.no_grad()
    def encode_images(self, images: Sequence[Sequence[Image.Image]] | torch.Tensor) -> torch.Tensor:
        """Latents [B, C, F', H', W'] of videos: a list of videos (each a list of PIL frames, all of one size and
        count) or a [B, 3, F, H, W] tensor in [-1, 1]. Through the VAE the latent distribution's mode,
        normalised per channel; in pixel space the identity."""
        if isinstance(images, torch.Tensor):
            x = images
        else:
            videos = [[np.asarray(frame.convert("RGB"), dtype=np.float32) for frame in video] for video in images]
            shapes = {(len(v), *v[0].shape) for v in videos if v}
            if not videos or any(not v for v in videos) or len(shapes) != 1 or \
                    any(len({f.shape for f in v}) != 1 for v in videos):
                raise ValueError("WanFlowModel.encode_images: videos must be a non-empty list of non-empty frame lists "
                                 "of one frame count and size")
            x = torch.from_numpy(np.stack([np.stack(v) for v in videos])).permute(0, 4, 1, 2, 3) / 127.5 - 1.0
        if x.dim() != 5:
            raise ValueError(f"WanFlowModel.encode_images: videos must be [B, 3, F, H, W], got shape {tuple(x.shape)}")
        x = x.to(self.device, torch.float32)
        if self.vae is None:
            return x.to(self.dtype)
        z = self.vae.encode(x.to(self.vae.dtype)).latent_dist.mode()
        mean, inverse_std = self._latent_stats(z)
        return ((z - mean) * inverse_std).to(self.dtype)

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(latents_mean, 1 / latents_std) as [1, z_dim, 1, 1, 1], WanPipeline's per-channel normalisation."""
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(like.device, self.vae.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(like.device, self.vae.dtype)
        return mean, inverse_std


def load_wan(path: Path, dtype: torch.dtype, max_sequence_length: int) -> WanFlowModel:
    """A ``WanPipeline`` directory as a ``WanFlowModel`` (``FLOW_FAMILIES`` "wan"); prompts are encoded to
    ``max_sequence_length`` UMT5 tokens."""
    from diffusers import WanPipeline

    pipeline = load_pipeline(Path(path), WanPipeline, _WAN_REQUIRED, dtype)
    if getattr(pipeline, "transformer_2", None) is not None or pipeline.config.get("boundary_ratio") is not None:
        raise ValueError(f"load_flow_model: {path} is a two-expert Wan 2.2 pipeline (transformer_2, boundary_ratio), "
                         "which grouprl does not train: LoRA on one transformer only")
    return WanFlowModel(
        transformer=pipeline.transformer, scheduler=pipeline.scheduler, vae=pipeline.vae,
        text_encoders=[pipeline.text_encoder], tokenizers=[pipeline.tokenizer], path=Path(path), pipeline=pipeline,
        max_sequence_length=max_sequence_length,
    )


# ---------------------------------------------------------------- the tiny stand-in


def build_tiny_wan_pipeline(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vae: bool = True,
    corpus: Sequence[str] | None = None,
    num_layers: int = 1,
    num_attention_heads: int = 2,
    attention_head_dim: int = 8,
    text_hidden_size: int = 16,
    latent_channels: int = 4,
    flow_shift: float = 3.0,
    scheduler: str = "euler",
) -> Path:
    """Build a randomly initialised ``WanPipeline`` and ``save_pretrained`` it to ``out_dir``.

    The parts are Wan's classes at a tiny size: a one-layer ``UMT5EncoderModel`` of width
    ``text_hidden_size`` (the transformer's ``text_dim``) with a T5 tokenizer built from ``corpus``
    (``tiny.build_t5_tokenizer``; by default the shapes task's prompts), a ``WanTransformer3DModel``
    of ``num_layers`` blocks with patches (1, 2, 2), and an ``AutoencoderKLWan`` (spatial factor 8,
    temporal 4; ``latent_channels`` channels, with per-channel latents_mean / latents_std that
    are not 0 / 1 so decoding exercises them). 16 x 16 pixels and 5 frames give latents
    [4, 2, 2, 2]. ``vae=False`` saves the VAE null: the transformer then works on RGB pixels
    (3 channels; 5 frames of 16 x 16 are latents [3, 5, 16, 16]).

    ``scheduler``: ``"euler"`` saves ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (as
    diffusers' Wan tests; the pipeline's own ``__call__`` then takes the same Euler steps as the
    ODE sampler), ``"unipc"`` the real Wan's ``UniPCMultistepScheduler`` config (flow sigmas,
    ``flow_shift``, flow prediction).
    """
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    from grouprl.domains.diffusion import shapes
    from grouprl.domains.diffusion.tiny import _seeded, build_t5_tokenizer
    from grouprl.files import follow_umask

    schedulers = {
        "euler": lambda: FlowMatchEulerDiscreteScheduler(shift=flow_shift),
        # Wan2.1-T2V's scheduler_config.json: UniPC over flow sigmas shifted by flow_shift
        "unipc": lambda: UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=flow_shift, num_train_timesteps=1000),
    }
    if scheduler not in schedulers:
        raise ValueError(f"build_tiny_wan_pipeline: scheduler must be one of {sorted(schedulers)}, got {scheduler!r}")
    out_dir = Path(out_dir)
    corpus = list(corpus) if corpus is not None else shapes.corpus()
    tokenizer = build_t5_tokenizer(corpus)
    text_config = UMT5Config(
        vocab_size=len(tokenizer), d_model=text_hidden_size, d_kv=text_hidden_size // 2, d_ff=2 * text_hidden_size,
        num_layers=1, num_heads=2, relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    text_encoder = _seeded(seed + 1, lambda: UMT5EncoderModel(text_config).eval())
    channels = latent_channels if vae else 3
    transformer = _seeded(seed, lambda: WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=num_attention_heads,
        attention_head_dim=attention_head_dim,
        in_channels=channels,
        out_channels=channels,
        text_dim=text_hidden_size,
        freq_dim=16,
        ffn_dim=2 * num_attention_heads * attention_head_dim,
        num_layers=num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ))
    autoencoder = None
    if vae:
        autoencoder = _seeded(seed + 2, lambda: AutoencoderKLWan(
            base_dim=4, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=np.linspace(-0.5, 0.5, latent_channels).round(4).tolist(),
            latents_std=np.linspace(0.8, 2.0, latent_channels).round(4).tolist(),
        ))
    pipeline = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=autoencoder,
                           scheduler=schedulers[scheduler](), transformer=transformer)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir

