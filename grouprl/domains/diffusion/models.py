"""Flow-matching image models loaded from a local directory, behind one small interface.

Two layouts load:

* a diffusers pipeline directory (``model_index.json``), of one of the model families
  in ``FLOW_FAMILIES`` (the pipeline class its ``_class_name`` names picks the family).
  ``sd3`` is ``StableDiffusion3Pipeline``: loaded through its ``from_pretrained``, and
  prompts are encoded by the pipeline's own ``encode_prompt`` (two CLIPs, optional
  T5), so the embeddings are exactly those the pipeline would use. Each other family
  is a ``FlowModel`` subclass in ``grouprl.domains.diffusion.families``, which does the
  same through its own pipeline's components;
* grouprl's own layout (``flow_model.json``): a transformer, a scheduler, one CLIP
  text encoder and its tokenizer, and optionally a VAE (``null`` for a model that
  works in pixel space). ``grouprl.domains.diffusion.tiny.build_tiny_pixel_flow`` writes
  one; the entries name the class of each component's folder, as diffusers'
  ``model_index.json`` does.

Everything downstream (pretraining, the RL sampler, the trainer) sees a ``FlowModel``:
the transformer predicts the velocity v = eps - x0 of the rectified flow
x_t = (1 - t) x0 + t eps at timestep 1000 t, whatever the layout. What differs between
families is behind five methods: ``condition`` (prompts to the family's
``pipeline.Conditioning``, which also knows how to call the transformer),
``schedule`` (the sigmas, with the family's resolution-dependent shift),
``latent_shape``, ``decode`` / ``encode_images``, and ``lora_targets``.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from PIL import Image

from grouprl.errors import ModelPathError
from grouprl.registry import Registry

MODEL_INDEX = "model_index.json"
FLOW_INDEX = "flow_model.json"
FLOW_FORMAT = "grouprl-flow"

# Components a StableDiffusion3Pipeline directory must have; T5 (text_encoder_3 and
# tokenizer_3) may be null, as SD3 runs without it (its tokens are then zeros).
_SD3_REQUIRED = ("transformer", "scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
_FLOW_REQUIRED = ("transformer", "scheduler", "text_encoder", "tokenizer")
_FLOW_COMPONENTS = _FLOW_REQUIRED + ("vae",)
# Libraries a flow_model.json entry may name: the file names classes to import.
_LIBRARIES = ("diffusers", "transformers")

# The LoRA targets of flow_grpo's and NVlabs' DiffusionNFT SD3 scripts (yifan123/flow_grpo scripts/train_sd3.py,
# NVlabs/DiffusionNFT's trainer: ``target_modules``): the joint blocks' image-stream q/k/v/out and text-stream
# added q/k/v/out under ``attn.`` (the last block has no to_add_out, its text output being unused). The ``attn.``
# prefix leaves out SD3.5's second, image-only attention (``attn2``, in the dual-attention blocks), as theirs
# does: on SD3.5-medium that is 4 of 12 LoRA'd projections fewer in each of its 13 dual-attention blocks.
_ATTENTION_PROJECTIONS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                          "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")


@dataclass
class FlowModel:
    """A flow-matching model: transformer, scheduler, optional VAE and frozen text encoder(s).

    ``pipeline`` is set when the model came from a StableDiffusion3Pipeline directory;
    its ``encode_prompt`` then encodes prompts, with T5 sequences of
    ``max_sequence_length`` tokens. ``text_encoders``/``tokenizers`` list the text
    side either way (in the pipeline's order), frozen and in eval mode.
    """

    transformer: Any
    scheduler: Any
    vae: Any | None
    text_encoders: list[torch.nn.Module]
    tokenizers: list[Any]
    path: Path
    pipeline: Any | None = None
    max_sequence_length: int = 256

    family = "sd3"  # the FLOW_FAMILIES name of the class
    video = False  # a text-to-video family: latents [C, F, H, W], decode gives frames per sample
    negative_prompt = ""  # the unconditional prompt of guidance (and of pretraining's prompt dropout)

    # ------------------------------------------------------------ geometry

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.transformer.parameters()).dtype

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side (1 in pixel space)."""
        if self.vae is None:
            return 1
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    @property
    def default_size(self) -> int:
        """The image side (pixels) the transformer was configured for."""
        return int(self.transformer.config.sample_size) * self.vae_scale_factor

    def latent_shape(self, height: int, width: int, frames: int | None = None) -> tuple[int, ...]:
        """(channels, h, w) of the latents of a ``height`` x ``width`` image (a video family: (c, f, h, w)
        of ``frames`` frames; an image family refuses frames)."""
        if frames is not None:
            raise ValueError(f"FlowModel({self.path}): a {self.family} model makes images, not videos "
                             f"(frames {frames} given)")
        multiple = self.vae_scale_factor * int(self.transformer.config.patch_size)
        if height <= 0 or width <= 0 or height % multiple or width % multiple:
            raise ValueError(f"FlowModel({self.path}): height and width must be positive multiples of "
                             f"{multiple} (VAE factor x patch size), got {height} x {width}")
        factor = self.vae_scale_factor
        return int(self.transformer.config.in_channels), height // factor, width // factor

    def schedule(self, num_steps: int, height: int, width: int, frames: int | None = None):
        """The ``pipeline.Schedule`` of ``num_steps`` steps for samples of this size, from a fresh copy of the
        model's scheduler (its own keeps its state). SD3's shift is fixed, so the size does not enter."""
        from grouprl.domains.diffusion.pipeline import schedule

        return schedule(type(self.scheduler).from_config(self.scheduler.config), num_steps)

    def lora_targets(self) -> list[str]:
        """peft ``target_modules`` for ``lora.target_modules: [attention]``: ``lora_target_modules``."""
        return lora_target_modules(self.transformer)

    # ------------------------------------------------------------ text

    @torch.no_grad()
    def condition(self, prompts: Sequence[str], guidance_scale: float = 1.0):
        """``pipeline.PromptEmbeddings`` of ``prompts`` (and of the empty prompt, guidance's unconditional
        input, when ``guidance_scale`` is not 1), on the model's device."""
        from grouprl.domains.diffusion.pipeline import PromptEmbeddings

        embeds, pooled = self.encode_prompts(prompts)
        if guidance_scale == 1.0:
            return PromptEmbeddings(embeds, pooled)
        negative, negative_pooled = self.encode_prompts([self.negative_prompt] * len(embeds))
        return PromptEmbeddings(embeds, pooled, negative, negative_pooled)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt_embeds [B, L, joint_attention_dim], pooled_prompt_embeds [B, pooled_projection_dim]).

        The unconditional input of classifier-free guidance is ``encode_prompts([""] * n)``.
        """
        prompts = list(prompts)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("FlowModel.encode_prompts: prompts must be a non-empty list of strings")
        if self.pipeline is not None:
            embeds, _, pooled, _ = self.pipeline.encode_prompt(
                prompt=prompts, prompt_2=None, prompt_3=None, device=self.device,
                do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length,
            )
        else:
            embeds, pooled = self._encode_clip(prompts)
        return embeds.to(self.dtype), pooled.to(self.dtype)

    def _encode_clip(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        # One CLIP: its last hidden states are the tokens, its projected EOS state the
        # pooled vector; like SD3 the tokens are zero-padded up to the transformer's width.
        tokenizer, encoder = self.tokenizers[0], self.text_encoders[0]
        ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length,
                        truncation=True, return_tensors="pt").input_ids.to(self.device)
        out = encoder(ids)
        embeds, pooled = out.last_hidden_state, out.text_embeds
        width = int(self.transformer.config.joint_attention_dim)
        if embeds.shape[-1] > width:
            raise ValueError(f"FlowModel({self.path}): the text encoder's width {embeds.shape[-1]} exceeds the "
                             f"transformer's joint_attention_dim {width}")
        return torch.nn.functional.pad(embeds, (0, width - embeds.shape[-1])), pooled

    # ------------------------------------------------------------ images

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> list[Image.Image]:
        """RGB images of a batch of latents (through the VAE, or read as pixels in [-1, 1]); a video family
        returns each sample's frames, a list of images, instead."""
        x = latents.to(self.device)
        if self.vae is not None:
            x = x / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0.0)
            x = self.vae.decode(x.to(self.vae.dtype), return_dict=False)[0]
        pixels = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return [Image.fromarray(a, mode="RGB") for a in pixels.permute(0, 2, 3, 1).cpu().numpy()]

    @torch.no_grad()
    def encode_images(self, images: Sequence[Image.Image] | torch.Tensor) -> torch.Tensor:
        """Latents of images (PIL images of one size, or a [B, 3, H, W] tensor in [-1, 1]).

        Through the VAE this takes the mean of its latent distribution (deterministic),
        scaled and shifted as the pipeline expects; in pixel space it is the identity.
        """
        if isinstance(images, torch.Tensor):
            x = images
        else:
            arrays = [np.asarray(image.convert("RGB"), dtype=np.float32) for image in images]
            if not arrays or len({a.shape for a in arrays}) != 1:
                raise ValueError("FlowModel.encode_images: images must be a non-empty list of one size, got "
                                 f"sizes {sorted({a.shape[:2] for a in arrays})}")
            x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1.0
        x = x.to(self.device, torch.float32)
        if self.vae is None:
            return x.to(self.dtype)
        latents = self.vae.encode(x.to(self.vae.dtype)).latent_dist.mode()
        latents = (latents - (self.vae.config.shift_factor or 0.0)) * self.vae.config.scaling_factor
        return latents.to(self.dtype)


def lora_target_modules(transformer: torch.nn.Module) -> list[str]:
    """The attention projection names (peft ``target_modules`` suffixes) present in ``transformer``: the
    peers' SD3 list (``_ATTENTION_PROJECTIONS``; SD3.5's ``attn2`` is not among them).

    Only names that end some ``nn.Linear`` in the module tree are returned, so a
    one-block model without ``to_add_out`` gets the seven it has. ValueError when
    there are none (not an SD3-style transformer).
    """
    return present_targets(transformer, _ATTENTION_PROJECTIONS, "the attention projections")


def present_targets(transformer: torch.nn.Module, targets: Sequence[str], what: str) -> list[str]:
    """The peft ``target_modules`` suffixes of ``targets`` (in their order) that end the name of some
    ``nn.Linear`` of ``transformer``; ValueError naming ``what`` when none does."""
    linear = [name for name, module in transformer.named_modules() if isinstance(module, torch.nn.Linear)]
    found = [t for t in targets if any(n == t or n.endswith("." + t) for n in linear)]
    if not found:
        raise ValueError(f"{type(transformer).__name__} has none of {what} {tuple(targets)}")
    return found


# ---------------------------------------------------------------- families


@dataclass(frozen=True)
class FlowFamily:
    """A model family: the diffusers pipeline class whose directories it loads, and its loader
    ``load(path, dtype, max_sequence_length) -> FlowModel`` (a function or a ``"module:attr"`` reference);
    ``max_sequence_length`` is the prompt length its pipeline's ``__call__`` uses by default."""

    pipeline_class: str
    load: Any
    video: bool = False
    description: str = ""
    # the prompt length (text-encoder tokens) when the config leaves it unset: the pipeline's own default
    max_sequence_length: int = 256


def _check_family(name: str, family: Any) -> None:
    if not isinstance(family, FlowFamily):
        raise TypeError(f"flow model family {name!r} must be a FlowFamily, got {type(family).__name__}")


FLOW_FAMILIES: Registry[FlowFamily] = Registry("flow model family", error=ValueError, check=_check_family)
FLOW_FAMILIES.register("sd3", FlowFamily("StableDiffusion3Pipeline", "grouprl.domains.diffusion.models:_load_sd3",
                                         description="Stable Diffusion 3 / 3.5"))
FLOW_FAMILIES.register("flux", FlowFamily("FluxPipeline", "grouprl.domains.diffusion.families.flux:load_flux",
                                          video=False, description="FLUX.1 dev / schnell (guidance embedding)",
                                          max_sequence_length=512))
FLOW_FAMILIES.register("wan", FlowFamily("WanPipeline", "grouprl.domains.diffusion.families.wan:load_wan", video=True,
                                         description="Wan 2.1 / 2.2 text-to-video (one transformer)",
                                         max_sequence_length=512))
FLOW_FAMILIES.register("qwen_image", FlowFamily("QwenImagePipeline", "grouprl.domains.diffusion.families.qwen_image:"
                                                "load_qwen_image", video=False, description="Qwen-Image",
                                                max_sequence_length=512))


def family_of_pipeline(class_name: Any) -> str:
    """The FLOW_FAMILIES name whose pipeline class is ``class_name``; ValueError naming the class and the
    supported pipelines otherwise."""
    for name in FLOW_FAMILIES:
        if FLOW_FAMILIES.get(name).pipeline_class == class_name:
            return name
    supported = ", ".join(f"{FLOW_FAMILIES.get(n).pipeline_class} ({n})" for n in FLOW_FAMILIES)
    raise ValueError(f"{class_name!r} is not a supported flow model family; supported pipelines: {supported} "
                     "(and grouprl's own flow_model.json layout)")


def _model_directory(path: str | Path) -> Path:
    """``path`` as a Path when it is a directory holding one of the two indexes; ModelPathError otherwise."""
    path = Path(path)
    if not path.is_dir():
        raise ModelPathError(f"flow model path {str(path)!r} is not a directory"
                             + ("" if path.exists() else " (it does not exist)"), str(path))
    if not (path / FLOW_INDEX).is_file() and not (path / MODEL_INDEX).is_file():
        raise ModelPathError(f"flow model path {str(path)!r} has neither {MODEL_INDEX} (a diffusers pipeline "
                             f"directory) nor {FLOW_INDEX} (grouprl's layout)", str(path))
    return path


def family_of_path(path: str | Path) -> str:
    """The family of the model directory ``path`` from its index alone (nothing loaded): its pipeline
    class's, or ``sd3`` for grouprl's own layout (an SD3 transformer). ModelPathError / ValueError as
    ``load_flow_model`` would raise them."""
    path = _model_directory(path)
    if (path / FLOW_INDEX).is_file():
        return "sd3"
    try:
        return family_of_pipeline(_read_index(path, MODEL_INDEX).get("_class_name"))
    except ValueError as error:
        raise ValueError(f"load_flow_model: {path / MODEL_INDEX}: {error}") from None


def _resolve(reference: Any):
    if callable(reference):
        return reference
    module, _, attr = str(reference).partition(":")
    return getattr(importlib.import_module(module), attr)


# ---------------------------------------------------------------- loading


def load_flow_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                    max_sequence_length: int | None = None) -> FlowModel:
    """Load a flow model from a local directory (see the module docstring for the two layouts).

    Text encoders and the VAE are frozen (``requires_grad`` off, eval mode); the
    transformer is returned as loaded. ``max_sequence_length`` is the prompt length in
    text-encoder tokens (SD3's T5 tokens, zeros when T5 is absent; FLUX's T5; Qwen-Image's
    and Wan's); None: the family's pipeline default (``FlowFamily.max_sequence_length``:
    SD3 256, the others 512). grouprl's own layout has no such length (one CLIP).
    """
    path = _model_directory(path)
    if (path / FLOW_INDEX).is_file():
        model = _load_flow_layout(path, dtype)
    else:
        entry = FLOW_FAMILIES.get(family_of_path(path))
        length = entry.max_sequence_length if max_sequence_length is None else int(max_sequence_length)
        if length < 1:
            raise ValueError(f"load_flow_model: max_sequence_length must be >= 1, got {length}")
        model = _resolve(entry.load)(path, dtype, length)
    for module in [*model.text_encoders, model.vae]:
        if module is not None:
            module.requires_grad_(False).eval()
    model.transformer.to(device)
    for module in [*model.text_encoders, model.vae]:
        if module is not None:
            module.to(device)
    return model


def _read_index(path: Path, name: str) -> dict:
    try:
        return json.loads((path / name).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"load_flow_model: {path / name} is not valid JSON ({error})") from None


def _present(entry: Any) -> bool:
    # diffusers writes an absent component as [null, null]
    return entry is not None and not (isinstance(entry, list) and all(e is None for e in entry))


def _component(entry: Any) -> bool:
    # a component's entry is [library, class]; a pipeline's own settings (WanPipeline's
    # boundary_ratio, expand_timesteps) sit beside them as plain values
    return isinstance(entry, list)


def _check_components(path: Path, index: dict, required: Sequence[str], index_name: str) -> None:
    for name in required:
        if not _present(index.get(name)):
            raise FileNotFoundError(f"load_flow_model: {path / index_name} lists no {name!r} component, "
                                    f"which is required")
    for name, entry in index.items():
        if not name.startswith("_") and _component(entry) and _present(entry) and not (path / name).is_dir():
            raise FileNotFoundError(f"load_flow_model: {path} is missing the {name!r} component "
                                    f"(no folder {path / name}, which {index_name} lists)")


def _load_sd3(path: Path, dtype: torch.dtype, max_sequence_length: int) -> FlowModel:
    from diffusers import StableDiffusion3Pipeline

    pipeline = load_pipeline(path, StableDiffusion3Pipeline, _SD3_REQUIRED, dtype)
    encoders = [pipeline.text_encoder, pipeline.text_encoder_2, pipeline.text_encoder_3]
    tokenizers = [pipeline.tokenizer, pipeline.tokenizer_2, pipeline.tokenizer_3]
    return FlowModel(
        transformer=pipeline.transformer, scheduler=pipeline.scheduler, vae=pipeline.vae,
        text_encoders=[e for e in encoders if e is not None], tokenizers=[t for t in tokenizers if t is not None],
        path=path, pipeline=pipeline, max_sequence_length=max_sequence_length,
    )


def load_pipeline(path: Path, pipeline_class: type, required: Sequence[str], dtype: torch.dtype):
    """``pipeline_class.from_pretrained(path)``, offline, after checking that ``model_index.json`` names the
    class and lists the ``required`` components, each with its folder. A component saved as null (SD3
    without T5, a pixel-space stand-in without a VAE) is loaded as None: diffusers loads it only when told."""
    index = _read_index(path, MODEL_INDEX)
    if index.get("_class_name") != pipeline_class.__name__:
        raise ValueError(f"load_flow_model: {path / MODEL_INDEX} describes a {index.get('_class_name')!r}, "
                         f"not a {pipeline_class.__name__}")
    _check_components(path, index, required, MODEL_INDEX)
    absent = {name: None for name, entry in index.items()
              if not name.startswith("_") and _component(entry) and not _present(entry)}
    pipeline = pipeline_class.from_pretrained(path, dtype=dtype, local_files_only=True, **absent)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _component_class(path: Path, name: str, entry: Any) -> type:
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in _LIBRARIES and isinstance(entry[1], str)):
        raise ValueError(f"load_flow_model: {path / FLOW_INDEX} entry {name!r} must be [library, class] with "
                         f"library one of {_LIBRARIES}, got {entry!r}")
    cls = getattr(importlib.import_module(entry[0]), entry[1], None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"load_flow_model: {path / FLOW_INDEX} names {entry[0]}.{entry[1]} for {name!r}, "
                         "which is not a loadable class")
    return cls


def _load_flow_layout(path: Path, dtype: torch.dtype) -> FlowModel:
    index = _read_index(path, FLOW_INDEX)
    if index.get("_format") != FLOW_FORMAT:
        raise ValueError(f"load_flow_model: {path / FLOW_INDEX} has _format {index.get('_format')!r}, "
                         f"expected {FLOW_FORMAT!r}")
    _check_components(path, index, _FLOW_REQUIRED, FLOW_INDEX)
    parts: dict[str, Any] = {}
    for name in _FLOW_COMPONENTS:
        entry = index.get(name)
        if not _present(entry):
            parts[name] = None
            continue
        cls = _component_class(path, name, entry)
        folder = path / name
        # Schedulers and tokenizers have no weights to cast.
        parts[name] = cls.from_pretrained(folder) if name in ("scheduler", "tokenizer") else \
            cls.from_pretrained(folder, dtype=dtype)
    return FlowModel(
        transformer=parts["transformer"], scheduler=parts["scheduler"], vae=parts["vae"],
        text_encoders=[parts["text_encoder"]], tokenizers=[parts["tokenizer"]], path=path,
    )
