"""Qwen-Image (diffusers' ``QwenImagePipeline``) as a grouprl flow model family.

Everything goes through the pipeline's own components and helpers:

* prompts: the pipeline's ``encode_prompt`` (Qwen2.5-VL's last hidden states of the
  prompt in the pipeline's chat template, the template's first
  ``prompt_template_encode_start_idx`` tokens dropped, with a mask). The pipeline pads a
  batch to its longest prompt; grouprl pads every batch to ``max_sequence_length``
  (zeros, mask 0) so micro-batches of different prompts concatenate. The transformer
  masks padded text out of the joint attention and gives text its RoPE positions from
  the start, so the padding changes the image tokens only by float rounding (the tests
  compare the pipeline's own sampling to grouprl's at 1e-5);
* latents stay in the unpacked layout [C, h, w] (the VAE's latent grid, or RGB pixels
  for the stand-in without a VAE) everywhere outside the transformer call:
  ``QwenImageConditioning.velocity`` packs them into 2 x 2 patches with the pipeline's
  ``_pack_latents`` and unpacks the velocity with ``_unpack_latents``, builds
  ``img_shapes`` as the pipeline does and gives the transformer ``timestep / 1000``;
* guidance: the pipeline's true CFG with the negative prompt " " (``true_cfg_velocity``,
  the norm-preserving rescale, taken per packed token as the pipeline does);
* the schedule: ``calculate_shift`` of the packed image's token count with the
  scheduler's own settings gives ``mu``; the scheduler applies its dynamic (exponential)
  shift to the pipeline's sigmas ``linspace(1, 1/N, N)``;
* images: the VAE (``AutoencoderKLQwenImage``, a frame axis of 1) with the
  ``latents_mean`` / ``latents_std`` normalisation of its pipelines; the pipeline's
  ``image_processor`` turns pixels into PIL images and back.

``build_tiny_qwen_image_pipeline`` writes a complete tiny ``QwenImagePipeline`` offline
(one transformer layer, a one-layer Qwen2.5-VL whose tokenizer makes the prompt
template's drop index the real one); with ``vae=False`` it is the pixel-space stand-in
the CPU demo uses.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from grouprl.domains.diffusion.models import FlowModel, load_pipeline
from grouprl.domains.diffusion.pipeline import RowTensors
from grouprl.files import follow_umask

# The negative prompt of true CFG: verl's examples/flowgrpo_trainer/data_process/qwenimage_ocr.py
# (negative_user_prompt " ") and flow_grpo's scripts/train_qwenimage_edit_plus.py (negative_prompt [" "]).
NEGATIVE_PROMPT = " "

# LoRA targets: verl's examples/flowgrpo_trainer/run_qwen_image_ocr_lora.sh (verl-project/verl,
# actor_rollout_ref.model.target_modules): the joint attention's image and text projections and both
# streams' MLPs.
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2")

# The last block's layers only its text-stream output reads, which the transformer discards
# (see QwenImageFlowModel.lora_targets).
_DISCARDED = ("add_q_proj", "to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
_REQUIRED = ("transformer", "scheduler", "text_encoder", "tokenizer")  # the VAE is null in the pixel stand-in
# The pipeline refuses longer prompts (check_inputs).
_MAX_SEQUENCE_LENGTH = 1024
# The image side a tiny stand-in was built for, kept in its transformer config: a private key,
# which diffusers stores and ignores (the real checkpoint has none).
_SIZE_KEY = "_grouprl_image_size"


def _pipeline_class():
    from diffusers import QwenImagePipeline

    return QwenImagePipeline


def true_cfg_velocity(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG on packed velocities [B, tokens, 4C]:

        v = u + w (c - u),   v <- v * |c| / |v|

    with the norms over the last (packed channel) axis, per token: the guided velocity
    rescaled to the conditional one's norm (``QwenImagePipeline.__call__``).
    """
    combined = uncond + scale * (cond - uncond)
    return combined * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


@dataclass
class QwenImageConditioning(RowTensors):
    """Qwen-Image's conditioning (``pipeline.Conditioning``): prompt embeddings padded to one length with
    their mask, and the negative prompt's for true CFG."""

    embeds: torch.Tensor  # [B, L, D]
    mask: torch.Tensor  # [B, L], 1 for a prompt token, 0 for padding
    negative_embeds: torch.Tensor | None = None  # [B, L, D]; None when guidance is off
    negative_mask: torch.Tensor | None = None

    def velocity(self, transformer, latents: torch.Tensor, timestep: torch.Tensor,
                 guidance_scale: float) -> torch.Tensor:
        """The velocity [B, C, h, w] of unpacked ``latents`` at the scheduler's ``timestep`` [B] (0..1000).

        One transformer call on 2B rows with true CFG (the prompt's first, the negative's
        second; the pipeline makes two calls, which differ only by float rounding).
        """
        pipeline = _pipeline_class()
        b, c, h, w = latents.shape
        packed = pipeline._pack_latents(latents, b, c, h, w)
        shapes = [[(1, h // 2, w // 2)]] * b
        t = timestep / 1000  # the pipeline's transformer takes the timestep in 0..1
        if guidance_scale <= 1.0:
            out = transformer(hidden_states=packed, timestep=t, encoder_hidden_states=self.embeds,
                              encoder_hidden_states_mask=self.mask, img_shapes=shapes, return_dict=False)[0]
        else:
            if self.negative_embeds is None:
                raise ValueError(f"guidance_scale {guidance_scale} needs the negative prompt's embeddings "
                                 "(condition with guidance)")
            both = transformer(hidden_states=torch.cat([packed, packed]), timestep=torch.cat([t, t]),
                               encoder_hidden_states=torch.cat([self.embeds, self.negative_embeds]),
                               encoder_hidden_states_mask=torch.cat([self.mask, self.negative_mask]),
                               img_shapes=shapes * 2, return_dict=False)[0]
            cond, uncond = both.chunk(2)
            out = true_cfg_velocity(cond, uncond, guidance_scale)
        # unpack at the latent grid itself: a VAE factor of 1 and the latent height and width
        return pipeline._unpack_latents(out, h, w, 1)[:, :, 0]


@dataclass
class QwenImageFlowModel(FlowModel):
    """A ``QwenImagePipeline`` as a ``FlowModel``: latents [C, h, w], true CFG, the dynamic shift."""

    family = "qwen_image"
    video = False
    # true CFG's unconditional text (pretraining's prompt dropout should use the same)
    negative_prompt = NEGATIVE_PROMPT

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side: 2 per temporal-downsample stage of the VAE (the
        pipeline's own factor, 8 for Qwen-Image), 1 in pixel space."""
        if self.vae is None:
            return 1
        return 2 ** len(self.vae.temperal_downsample)

    @property
    def default_size(self) -> int:
        """The image side a tiny stand-in was built for, else the pipeline's default
        (``default_sample_size`` x the VAE factor: 1024 for Qwen-Image)."""
        size = self.transformer.config.get(_SIZE_KEY)
        if size is not None:
            return int(size)
        return int(self.pipeline.default_sample_size) * self.vae_scale_factor

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(channels, h, w): the VAE's latent grid (the pipeline's unpacked latents without their frame
        axis), or RGB pixels; sides must be multiples of twice the VAE factor (the 2 x 2 packing)."""
        if frames is not None:
            raise ValueError(f"FlowModel({self.path}): a {self.family} model makes images, not videos "
                             f"(frames {frames} given)")
        multiple = 2 * self.vae_scale_factor
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(f"FlowModel({self.path}): height and width must be positive multiples of "
                             f"{multiple} (VAE factor x the 2 x 2 packing), got {height} x {width}")
        factor = self.vae_scale_factor
        return int(self.transformer.config.out_channels), height // factor, width // factor

    def schedule(self, num_steps: int, height: int, width: int, frames: int | None = None):
        """The schedule with the pipeline's shift: mu = ``calculate_shift`` of the packed image's token count
        (h/2 x w/2 latent patches) with the scheduler's base/max sequence lengths and shifts."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        from grouprl.domains.diffusion.pipeline import schedule

        _, h, w = self.latent_shape(height, width, frames)
        config = self.scheduler.config
        mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        return schedule(type(self.scheduler).from_config(config), num_steps, mu=mu)

    def lora_targets(self) -> list[str]:
        """peft ``target_modules``: the full names of the transformer's linear layers that end in one of
        verl's Qwen-Image targets (``LORA_TARGETS``: attention projections and MLPs), in module order, less
        the last block's layers that only its text-stream output reads (the text queries ``add_q_proj``,
        ``to_add_out``, ``txt_mlp``).

        The transformer reads only the image stream after its last block, so those layers never get a
        gradient (``add_q_proj`` a zero one, the others none): a LoRA there (verl wraps them) stays at
        its initial value, B = 0, so leaving it out changes no output; and AdamW keeps no state for a
        parameter without a gradient, which a resumed checkpoint's optimizer state would then lack.
        """
        last = f"transformer_blocks.{len(self.transformer.transformer_blocks) - 1}."
        names = [name for name, module in self.transformer.named_modules() if isinstance(module, torch.nn.Linear)
                 and any(name.endswith("." + t) for t in LORA_TARGETS)
                 and not (name.startswith(last) and any(name.endswith("." + t) for t in _DISCARDED))]
        if not names:
            raise ValueError(f"QwenImageFlowModel({self.path}): the transformer has none of the LoRA targets "
                             f"{LORA_TARGETS}")
        return names

    # ------------------------------------------------------------ text

    @torch.no_grad()
    def condition(self, prompts: Sequence[str], guidance_scale: float = 1.0) -> QwenImageConditioning:
        """``QwenImageConditioning`` of ``prompts``, with the negative prompt's when ``guidance_scale`` > 1
        (the pipeline's true CFG runs only above 1)."""
        if guidance_scale < 1.0:
            raise ValueError(f"QwenImageFlowModel: guidance_scale {guidance_scale} is below 1; Qwen-Image's true "
                             "CFG runs above 1 and 1 turns it off")
        embeds, mask = self.encode_prompts(prompts)
        if guidance_scale == 1.0:
            return QwenImageConditioning(embeds, mask)
        negative, negative_mask = self.encode_prompts([self.negative_prompt])
        n = len(embeds)
        return QwenImageConditioning(embeds, mask, negative.expand(n, -1, -1).clone(),
                                     negative_mask.expand(n, -1).clone())

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, max_sequence_length, D], mask [B, max_sequence_length]): the pipeline's
        ``encode_prompt``, zero-padded (mask 0) from the batch's longest prompt to ``max_sequence_length``."""
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("QwenImageFlowModel.encode_prompts: prompts must be a non-empty list of strings")
        embeds, mask = self.pipeline.encode_prompt(prompt=prompts, device=self.device,
                                                   max_sequence_length=self.max_sequence_length)
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        pad = self.max_sequence_length - embeds.shape[1]
        embeds = torch.nn.functional.pad(embeds, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask.to(torch.long), (0, pad))
        return embeds.to(self.dtype), mask

    # ------------------------------------------------------------ images

    def _latent_stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the pipelines' normalisation: mean and 1 / std, shaped [1, z, 1, 1, 1] (a frame axis)
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(like.device, like.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(like.device,
                                                                                                 like.dtype)
        return mean, inverse_std

    @torch.no_grad()
    def decode(self, latents: torch.Tensor):
        """RGB images of latents [B, C, h, w]: x / (1 / std) + mean on a frame axis of 1 through the VAE, as
        ``QwenImagePipeline.__call__``; in pixel space the pixels in [-1, 1] themselves."""
        if self.vae is None:
            return super().decode(latents)
        x = latents.to(self.device, self.vae.dtype).unsqueeze(2)
        mean, inverse_std = self._latent_stats(x)
        pixels = self.vae.decode(x / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return self.pipeline.image_processor.postprocess(pixels, output_type="pil")

    @torch.no_grad()
    def encode_images(self, images) -> torch.Tensor:
        """Latents [B, C, h, w] of PIL images of one size (or a [B, 3, H, W] tensor in [-1, 1]): the mode of
        the VAE's latent distribution, normalised (z - mean) * (1 / std) as Qwen-Image's img2img pipeline."""
        if self.vae is None:
            return super().encode_images(images)
        if isinstance(images, torch.Tensor):
            x = images
        else:
            images = list(images)
            if not images or len({image.size for image in images}) != 1:
                raise ValueError("QwenImageFlowModel.encode_images: images must be a non-empty list of one size, "
                                 f"got sizes {sorted({image.size for image in images})}")
            width, height = images[0].size
            x = self.pipeline.image_processor.preprocess(images, height=height, width=width)
        x = x.to(self.device, self.vae.dtype).unsqueeze(2)
        latents = self.vae.encode(x).latent_dist.mode()
        mean, inverse_std = self._latent_stats(latents)
        return ((latents - mean) * inverse_std)[:, :, 0].to(self.dtype)


def load_qwen_image(path: Path, dtype: torch.dtype, max_sequence_length: int) -> QwenImageFlowModel:
    """A ``QwenImagePipeline`` directory as a ``QwenImageFlowModel`` (``FLOW_FAMILIES`` ``qwen_image``).

    The VAE may be null (the pixel-space stand-in). Prompts are padded to
    ``max_sequence_length`` tokens (1..1024, the pipeline's limit).
    """
    if not 1 <= max_sequence_length <= _MAX_SEQUENCE_LENGTH:
        raise ValueError(f"load_flow_model: max_sequence_length {max_sequence_length} is outside 1..."
                         f"{_MAX_SEQUENCE_LENGTH} (QwenImagePipeline's limit)")
    pipeline = load_pipeline(path, _pipeline_class(), _REQUIRED, dtype)
    config = pipeline.transformer.config
    if config.guidance_embeds:
        raise ValueError(f"load_flow_model: {path}: a guidance-distilled Qwen-Image transformer (guidance_embeds) "
                         "is not supported; grouprl runs Qwen-Image's true CFG")
    channels = pipeline.vae.config.z_dim if pipeline.vae is not None else 3
    if config.in_channels != 4 * channels or config.out_channels != channels:
        raise ValueError(f"load_flow_model: {path}: the transformer takes {config.in_channels} channels and gives "
                         f"{config.out_channels}; 2 x 2-packed latents of {channels} channels need "
                         f"{4 * channels} and {channels}")
    return QwenImageFlowModel(
        transformer=pipeline.transformer, scheduler=pipeline.scheduler, vae=pipeline.vae,
        text_encoders=[pipeline.text_encoder], tokenizers=[pipeline.tokenizer], path=path, pipeline=pipeline,
        max_sequence_length=max_sequence_length,
    )


# ---------------------------------------------------------------- tiny stand-in


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    # Qwen-Image splits a head's rotary dimensions frame:height:width as 16:56:56 of 128; the same
    # shares rounded to even sizes (each axis rotates pairs)
    side = (head_dim * 7 // 16) // 2 * 2
    frame = head_dim - 2 * side
    if head_dim % 2 or side < 2 or frame < 2:
        raise ValueError(f"build_tiny_qwen_image_pipeline: attention_head_dim {head_dim} is too small or odd for "
                         "three even RoPE axes (use 8 or more, even)")
    return frame, side, side


# Qwen-Image's scheduler: the dynamic, exponential time shift between base_shift at 256 image tokens and
# max_shift at 8192, stretched to end at shift_terminal (Qwen/Qwen-Image scheduler/scheduler_config.json).
_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9, shift=1.0,
                  shift_terminal=0.02, time_shift_type="exponential", use_dynamic_shifting=True)


def build_tiny_qwen_image_pipeline(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vae: bool = True,
    image_size: int | None = None,
    corpus: Sequence[str] | None = None,
    num_layers: int = 1,
    num_attention_heads: int = 2,
    attention_head_dim: int = 8,
    text_hidden_size: int = 32,
    latent_channels: int = 4,
) -> Path:
    """Build a randomly initialised ``QwenImagePipeline`` and ``save_pretrained`` it to ``out_dir``.

    * the transformer: ``num_layers`` Qwen-Image blocks of ``num_attention_heads`` x
      ``attention_head_dim``, reading ``text_hidden_size``-wide text, over 2 x 2-packed
      latents (``4 * latent_channels`` channels in, ``latent_channels`` out);
    * the text encoder: a one-layer Qwen2.5-VL of width ``text_hidden_size``
      (``grouprl.models.tiny.build_tiny_vlm``) whose byte-level BPE is trained on the
      corpus (default: the shapes task's prompts) inside the pipeline's prompt template,
      so the template's system part is 34 tokens as with Qwen's tokenizer, the drop
      index the pipeline hard-codes (checked here);
    * ``vae=True``: an ``AutoencoderKLQwenImage`` with one downsampling stage (factor 2)
      and non-trivial ``latents_mean`` / ``latents_std``; images of ``image_size``
      pixels (default 16: 8 x 8 latents, 16 tokens). ``vae=False``: no VAE (saved as
      null), the transformer works on RGB pixels (3 channels, 12 packed); images of
      ``image_size`` pixels (default 8: 16 tokens), the CPU demo's stand-in;
    * the scheduler: Qwen-Image's (dynamic exponential shift).

    The image side is recorded in the transformer config, so ``default_size`` is it.
    """
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from grouprl.domains.diffusion import shapes
    from grouprl.domains.diffusion.tiny import _seeded
    from grouprl.models.tiny import build_tiny_vlm

    out_dir = Path(out_dir)
    channels = latent_channels if vae else 3
    factor = 2 if vae else 1
    image_size = image_size if image_size is not None else (16 if vae else 8)
    if image_size <= 0 or image_size % (2 * factor):
        raise ValueError(f"build_tiny_qwen_image_pipeline: image_size must be a positive multiple of {2 * factor} "
                         f"(VAE factor {factor} x the 2 x 2 packing), got {image_size}")
    corpus = list(corpus) if corpus is not None else shapes.corpus()
    pipeline_class = _pipeline_class()
    # the template and drop index live on a pipeline instance; a component-less one has them
    probe = pipeline_class(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=None)
    template, drop = probe.prompt_template_encode, probe.prompt_template_encode_start_idx
    with tempfile.TemporaryDirectory() as scratch:
        # the tokenizer learns the template's words from templated prompts (each word at least twice)
        build_tiny_vlm(scratch, [template.format(p) for p in corpus], seed=seed + 1, vocab_size=4096,
                       hidden_size=text_hidden_size, layers=1, heads=2, kv_heads=1, vision_hidden_size=16,
                       vision_depth=1, vision_heads=1, image_size=56)
        encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(scratch).eval()
        tokenizer = AutoTokenizer.from_pretrained(scratch)
    tokenizer.padding_side = "right"  # Qwen2's tokenizer pads on the right; the pipeline selects by the mask anyway
    system = template.split("{}")[0]
    if len(tokenizer(system).input_ids) != drop:
        raise ValueError(f"build_tiny_qwen_image_pipeline: the tokenizer splits the prompt template's system part "
                         f"into {len(tokenizer(system).input_ids)} tokens, not the {drop} the pipeline drops; "
                         "give a corpus the template's words are learnt from")
    transformer = _seeded(seed, lambda: QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * channels, out_channels=channels, num_layers=num_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=text_hidden_size, axes_dims_rope=_rope_axes(attention_head_dim),
    ))
    transformer.register_to_config(**{_SIZE_KEY: image_size})
    autoencoder = None
    if vae:
        autoencoder = _seeded(seed + 2, lambda: AutoencoderKLQwenImage(
            base_dim=8, z_dim=channels, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False],
            # away from 0 and 1, so decode/encode exercise the normalisation
            latents_mean=[0.1 * (i - channels / 2) for i in range(channels)],
            latents_std=[0.5 + 0.25 * i for i in range(channels)],
        ))
    pipeline = pipeline_class(scheduler=FlowMatchEulerDiscreteScheduler(**_SCHEDULER), vae=autoencoder,
                              text_encoder=encoder, tokenizer=tokenizer, transformer=transformer)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out_dir, safe_serialization=True)
    follow_umask(out_dir)  # safetensors writes 0600 files
    return out_dir
