"""Turning Samples into model inputs: chat-template prompts, image tensors, forward kwargs.

One convention everywhere: token sequences are left-padded prompts followed by
right-padded responses, and the extra tensors of a row (``pixel_values``,
``image_grid_thw`` for Qwen-VL) live in one dict per row so any subset of rows
can be re-collated into a micro-batch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import weakref
from collections import OrderedDict
from typing import Any

import torch

from grouprl.data.sample import Sample

# Per-token outputs of a processor. They depend on the padding of the batch they
# end up in, so they are rebuilt from input_ids at forward time instead of stored.
_PER_TOKEN_KEYS = {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"}

TRUNCATION_MODES = ("error", "left")


def tokenizer_of(processor) -> Any:
    """The tokenizer inside a processor, or the processor itself for text models."""
    return getattr(processor, "tokenizer", processor)


def end_of_turn_id(tokenizer) -> int:
    """The token that ends an assistant turn: the chat template's end marker when there is one."""
    tokenizer = tokenizer_of(tokenizer)
    for token in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token in tokenizer.get_vocab():
            return token_id
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end a turn with")
    return tokenizer.eos_token_id


def pad_token_id(processor) -> int:
    tokenizer = tokenizer_of(processor)
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad_token nor an eos_token; set tokenizer.pad_token")
    return pad


def is_multimodal_processor(processor) -> bool:
    return hasattr(processor, "image_processor")


def render_prompt(processor, sample: Sample) -> str:
    """The sample's messages through the chat template (with ``sample.chat_template_kwargs``), ending
    with the assistant turn's header."""
    n_slots = _count_image_slots(sample)
    if n_slots != len(sample.images):
        raise ValueError(
            f"sample {sample.id}: the messages have {n_slots} image slot(s) but the sample has "
            f"{len(sample.images)} image(s)"
        )
    # A processor's own template is the one saved with the checkpoint; fall back to
    # the tokenizer's (text models, and processors saved without one).
    renderer = processor if getattr(processor, "chat_template", None) else tokenizer_of(processor)
    if getattr(renderer, "chat_template", None) is None:
        raise ValueError(f"{type(renderer).__name__} has no chat template; set processor.chat_template")
    messages = sample.messages if is_multimodal_processor(processor) else _text_messages(sample.messages)
    return renderer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                        **sample.chat_template_kwargs)


def _text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each content made of text items alone joined into one string.

    A text model's template takes a message's content as a string (Qwen2.5-Instruct's and Qwen3's
    concatenate it), while samples hold content items; a message with an image slot is left as it
    is, for ``encode_sample`` to refuse."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list) and all(item.get("type") == "text" for item in content):
            message = {**message, "content": "".join(item["text"] for item in content)}
        out.append(message)
    return out


def _count_image_slots(sample: Sample) -> int:
    count = 0
    for message in sample.messages:
        content = message.get("content")
        if isinstance(content, list):
            count += sum(1 for item in content if item.get("type") == "image")
    return count


def encode_sample(processor, sample: Sample) -> dict[str, torch.Tensor]:
    """Processor output for one sample (batch dimension 1), images included.

    The same prompt comes back every epoch (SFT, GRPO's prompts, evaluation), and rendering
    the template, tokenizing and above all preprocessing images cost more than a small
    model's step, so the output is remembered (``ENCODING_CACHE``) by the prompt's content:
    its messages, template arguments and image pixels. Treat the returned tensors as read-only.
    """
    if sample.images and not is_multimodal_processor(processor):
        raise ValueError(
            f"sample {sample.id} has {len(sample.images)} image(s) but {type(processor).__name__} "
            "is a text-only tokenizer; use a vision-language model or drop the images"
        )
    key = ENCODING_CACHE.key(processor, sample)
    encoded = ENCODING_CACHE.get(processor, key)
    if encoded is None:
        encoded = _encode_sample(processor, sample)
        ENCODING_CACHE.put(processor, key, encoded)
    return dict(encoded)


def _encode_sample(processor, sample: Sample) -> dict[str, torch.Tensor]:
    text = render_prompt(processor, sample)
    # The template already wrote every special token the model expects; a second
    # BOS from the tokenizer would shift the prompt away from what the model saw in training.
    if sample.images:
        return dict(processor(text=[text], images=list(sample.images), return_tensors="pt", add_special_tokens=False))
    if is_multimodal_processor(processor):
        return dict(processor(text=[text], return_tensors="pt", add_special_tokens=False))
    return dict(tokenizer_of(processor)([text], return_tensors="pt", add_special_tokens=False))


class EncodingCache:
    """Processor outputs of recent prompts, per processor, least recently used dropped past ``max_bytes``.

    A prompt's key is what its encoding depends on besides the processor: the messages,
    the chat-template arguments, the templates themselves, and each image's mode, size and
    pixels (a digest), with the image processor's resizing settings. A prompt whose messages
    JSON cannot write is encoded every time. ``GROUPRL_ENCODING_CACHE_MB`` sets the budget
    (default 1024; 0 turns the cache off).
    """

    _IMAGE_SETTINGS = ("size", "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                       "do_resize", "do_rescale", "do_normalize", "image_mean", "image_std", "resample")

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._by_processor: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()
        self._bytes: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()
        self.hits = self.misses = 0

    def key(self, processor, sample: Sample) -> str | None:
        if self.max_bytes <= 0:
            return None
        try:
            parts = [sample.messages, sample.chat_template_kwargs]
            text = json.dumps(parts, sort_keys=True)
        except (TypeError, ValueError):
            return None
        templates = (getattr(processor, "chat_template", None), getattr(tokenizer_of(processor), "chat_template", None))
        digest = hashlib.blake2b(text.encode(), digest_size=16)
        digest.update(repr(templates).encode())
        if sample.images:
            image_processor = getattr(processor, "image_processor", None)
            digest.update(repr([getattr(image_processor, name, None) for name in self._IMAGE_SETTINGS]).encode())
            for image in sample.images:
                digest.update(f"{image.mode}{image.size}".encode())
                digest.update(image.tobytes())
        return digest.hexdigest()

    def get(self, processor, key: str | None) -> dict[str, torch.Tensor] | None:
        if key is None:
            return None
        try:
            entries = self._by_processor.get(processor)
        except TypeError:  # a processor that cannot be weakly referenced or hashed: no cache
            return None
        found = entries.get(key) if entries is not None else None
        if found is None:
            self.misses += 1
            return None
        entries.move_to_end(key)
        self.hits += 1
        return found

    def put(self, processor, key: str | None, encoded: dict[str, torch.Tensor]) -> None:
        if key is None:
            return
        size = sum(v.numel() * v.element_size() for v in encoded.values() if isinstance(v, torch.Tensor))
        if size > self.max_bytes:
            return
        try:
            entries = self._by_processor.setdefault(processor, OrderedDict())
        except TypeError:
            return
        used = self._bytes.get(processor, 0)
        while entries and used + size > self.max_bytes:
            _, dropped = entries.popitem(last=False)
            used -= sum(v.numel() * v.element_size() for v in dropped.values() if isinstance(v, torch.Tensor))
        entries[key] = encoded
        self._bytes[processor] = used + size

    def clear(self) -> None:
        self._by_processor.clear()
        self._bytes.clear()


ENCODING_CACHE = EncodingCache(int(float(os.environ.get("GROUPRL_ENCODING_CACHE_MB", "1024")) * 2**20))


def encode_prompts(
    processor,
    samples: list[Sample],
    *,
    max_prompt_length: int | None = None,
    truncation: str = "error",
) -> tuple[torch.Tensor, torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Encode samples into left-padded prompt ids and per-sample extra model inputs.

    Returns ``(prompt_ids [N, P], prompt_mask [N, P], model_inputs)`` where
    ``model_inputs[i]`` holds sample i's non-token inputs (e.g. ``pixel_values``
    and ``image_grid_thw``), or is empty for a text prompt.

    A prompt longer than ``max_prompt_length`` raises a ValueError naming the
    sample (``truncation="error"``) or keeps its last tokens (``"left"``, which
    still refuses to cut into image tokens: the image features would no longer
    match the placeholders).
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation={truncation!r} is not one of {TRUNCATION_MODES}")
    if not samples:
        raise ValueError("encode_prompts: no samples")
    pad = pad_token_id(processor)
    rows: list[torch.Tensor] = []
    model_inputs: list[dict[str, torch.Tensor]] = []
    for sample in samples:
        encoded = encode_sample(processor, sample)
        ids = encoded["input_ids"][0]
        if "attention_mask" in encoded:
            ids = ids[encoded["attention_mask"][0].bool()]
        if max_prompt_length is not None and len(ids) > max_prompt_length:
            if truncation == "error":
                raise ValueError(
                    f"sample {sample.id}: the prompt has {len(ids)} tokens, more than "
                    f"max_prompt_length={max_prompt_length} (raise data.max_prompt_length or truncate)"
                )
            cut = ids[: len(ids) - max_prompt_length]
            if _has_multimodal_tokens(processor, cut):
                raise ValueError(
                    f"sample {sample.id}: left-truncating the prompt to max_prompt_length={max_prompt_length} "
                    "would remove image tokens; raise data.max_prompt_length or use smaller images"
                )
            ids = ids[len(ids) - max_prompt_length :]
        rows.append(ids)
        model_inputs.append({k: v for k, v in encoded.items() if k not in _PER_TOKEN_KEYS and v is not None})
    prompt_ids, prompt_mask = left_pad(rows, pad)
    return prompt_ids, prompt_mask, model_inputs


def _has_multimodal_tokens(processor, ids: torch.Tensor) -> bool:
    special = [getattr(processor, name, None) for name in ("image_token_id", "video_token_id")]
    return any(tok is not None and bool((ids == tok).any()) for tok in special)


def left_pad(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if len(row):
            ids[i, width - len(row) :] = row
            mask[i, width - len(row) :] = 1
    return ids, mask


def collate_model_inputs(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-row extra inputs along dim 0, in row order.

    Qwen-VL takes the patches of all images of a batch as one ``pixel_values``
    tensor with one ``image_grid_thw`` row per image, in the order the image
    tokens appear in ``input_ids``; concatenating rows in order keeps that.
    Rows without images simply contribute nothing.
    """
    keys: list[str] = []
    for row in rows:
        keys.extend(k for k in row if k not in keys)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [row[key] for row in rows if key in row]
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise TypeError(f"collate_model_inputs: model input {key!r} is not a tensor in every row")
        out[key] = torch.cat(parts, dim=0)
    return out


def forward_parameters(model) -> set[str]:
    """Names the underlying transformers model's ``forward`` accepts (through DDP and PEFT wrappers)."""
    base = unwrap_model(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    return set(inspect.signature(base.forward).parameters)


def unwrap_model(model):
    """The model inside DDP / accelerate wrappers (a PeftModel stays a PeftModel)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def model_device(model) -> torch.device:
    try:
        return next(unwrap_model(model).parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_config(model):
    base = unwrap_model(model)
    return base.config


def forward_kwargs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    extra: dict[str, torch.Tensor],
    *,
    generation: bool = False,
) -> dict[str, Any]:
    """Keyword arguments for ``model(...)`` / ``model.generate(...)`` on a padded batch.

    Positions are what make a left-padded row score like an unpadded one:
    - with images, Qwen-VL builds its 3-D M-RoPE positions from the attention
      mask itself; transformers >= 5 only does so when given
      ``mm_token_type_ids`` (0 text, 1 image, 2 video), which we rebuild from
      the ids because the processor's copy had another padding;
    - without images, positions count real tokens only (cumsum of the mask),
      which is what ``generate`` computes on its own (so ``generation=True``
      leaves them out: generate extends positions step by step itself).
    """
    device = input_ids.device
    kwargs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    kwargs.update({k: v.to(device) for k, v in extra.items()})
    accepted = forward_parameters(model)
    config = model_config(model)
    has_vision = any(k in extra for k in ("image_grid_thw", "video_grid_thw"))
    if has_vision:
        if "mm_token_type_ids" in accepted:
            types = torch.zeros_like(input_ids)
            image_id = getattr(config, "image_token_id", None)
            video_id = getattr(config, "video_token_id", None)
            if image_id is not None:
                types = types.masked_fill(input_ids == image_id, 1)
            if video_id is not None:
                types = types.masked_fill(input_ids == video_id, 2)
            kwargs["mm_token_type_ids"] = types
    elif not generation and "position_ids" in accepted:
        kwargs["position_ids"] = text_position_ids(attention_mask)
    return kwargs


def placeholder_token_ids(model) -> list[int]:
    """The multimodal placeholder tokens of the model's config (image, video, vision start/end).

    A response never contains them: every engine keeps them out of its samples (an image
    placeholder in a response would be taken for an image slot by the next forward), so the
    policy that samples, and that the trainer scores, is the model restricted to the other
    tokens (``grouprl.rollout.logprobs.forward_response_log_probs``).
    """
    config = model_config(model)
    ids: list[int] = []
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def text_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)
