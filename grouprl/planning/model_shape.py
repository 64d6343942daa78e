"""A model's numbers from its config alone: parameters counted on the meta device, no weights read.

``model_shape(path)`` reads the config through ``AutoConfig`` (a local directory or the local
Hugging Face cache; nothing is downloaded), builds the model with ``from_config`` under
``torch.device("meta")`` (the Auto class grouprl trains it with: image-text-to-text for a VLM,
causal LM otherwise), and counts the real architecture's parameters: the vision tower, tied
embeddings counted once, LoRA adapters through peft on the same meta model
(``grouprl.models.loading.apply_lora``, the function training uses), frozen parts through
``grouprl.models.loading.freeze``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelShape:
    """The counts the memory plan needs. ``parameters`` counts shared tensors once (tied embeddings)."""

    path: str
    model_type: str
    is_vlm: bool
    parameters: int
    trained_parameters: int  # with the run's freezing / LoRA applied (LoRA: the adapters)
    adapter_parameters: int  # LoRA adapters (0 without)
    linear_parameters: int  # the language model's linear weights and the output layer's (autocast copies)
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    checkpoint_dtype: str | None

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim


def _unique_numel(params) -> int:
    seen, total = set(), 0
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def model_shape(path: str, *, trust_remote_code: bool = False, lora_rank: int = 0, lora_alpha: float = 16,
                lora_targets: str | list[str] = "all-linear", lora_include_vision: bool = False,
                freeze_vision_tower: bool = False, trainable_modules: list[str] | None = None) -> ModelShape:
    """The shape of the model at ``path`` as training would build it (freezing and LoRA applied, on ``meta``).

    Raises ``grouprl.models.loading.ModelPathError`` when the config cannot be read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from grouprl.models.loading import _from_path, apply_lora, freeze, is_vision_language_config

    # offline: a plan reads what is here (a directory or the Hugging Face cache), never the network
    config = _from_path(AutoConfig.from_pretrained, path, "config", trust_remote_code=trust_remote_code,
                        local_files_only=True)
    is_vlm = is_vision_language_config(config)
    auto = AutoModelForImageTextToText if is_vlm else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config, trust_remote_code=trust_remote_code)
    total = _unique_numel(model.parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    # the matrices autocast casts: the language model's linear layers and the output layer
    from grouprl.models.loading import _outside, _vision_prefixes

    vision = _vision_prefixes(model)
    linear = _unique_numel(m.weight for name, m in model.named_modules()
                           if isinstance(m, torch.nn.Linear) and _outside(name, vision))
    freeze(model, freeze_vision_tower=freeze_vision_tower, trainable_modules=trainable_modules or None)
    trained = _unique_numel(p for p in model.parameters() if p.requires_grad)
    adapters = 0
    if lora_rank > 0:
        peft_model = apply_lora(model, rank=lora_rank, alpha=lora_alpha, target_modules=lora_targets,
                                exclude_vision=not lora_include_vision)
        adapters = _unique_numel(p for n, p in peft_model.named_parameters() if "lora_" in n)
        trained = adapters
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return ModelShape(
        path=str(path), model_type=str(getattr(config, "model_type", "?")), is_vlm=is_vlm, parameters=total,
        trained_parameters=trained, adapter_parameters=adapters, linear_parameters=linear, layers=layers,
        hidden=text.hidden_size, intermediate=text.intermediate_size, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=text.vocab_size,
        checkpoint_dtype=str(dtype).replace("torch.", "") if dtype is not None else None)


def image_tokens_per_image(path: str, *, max_pixels: int | None, trust_remote_code: bool = False) -> int | None:
    """Tokens of the largest image the data settings allow, by the model's own image processor.

    grouprl resizes each image to at most ``data.max_pixels`` (``grouprl.data.images``), then the
    processor the checkpoint names (``AutoImageProcessor``) applies its own bounds and reports the
    patches of a ``side x side`` image (``get_number_of_image_patches``: the Qwen-VL family's
    ``smart_resize``); the language model sees ``patches / merge_size^2`` tokens. The image is a
    square of ``max_pixels`` (without it, one larger than any processor keeps: its own maximum
    applies). None when the checkpoint has no image processor or it cannot count patches.
    """
    from transformers import AutoImageProcessor

    from grouprl.models.loading import _from_path

    try:
        processor = _from_path(AutoImageProcessor.from_pretrained, path, "image processor",
                               trust_remote_code=trust_remote_code, local_files_only=True)
    except (OSError, ValueError):  # a text model has no image processor
        return None
    count = getattr(processor, "get_number_of_image_patches", None)
    if count is None:
        return None
    side = math.isqrt(max_pixels) if max_pixels else 2**15
    merge = getattr(processor, "merge_size", 1) or 1
    return count(side, side, {}) // (merge * merge)
