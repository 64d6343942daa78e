"""The tokens between two policy turns: observation messages (user or tool, text and images)
rendered by the model's own chat template, in token space.

A multi-turn dialogue keeps the policy's sampled ids as they were sampled; only what comes
between two policy turns is tokenized: the end of the assistant turn, the observation messages
(an environment's reply, tool results), the next assistant header. :func:`between_turns` renders
them the way the template renders them and, when they hold images, runs that text through the
processor with the images, so the ids hold each image's expanded placeholder tokens and the
model inputs the image tensors (``pixel_values``, ``image_grid_thw``) for those placeholders.
:func:`append_model_inputs` adds those tensors to what the dialogue already had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image

from grouprl.models.inputs import _PER_TOKEN_KEYS, collate_model_inputs, end_of_turn_id, is_multimodal_processor, \
    tokenizer_of

OBSERVATION_ROLES = ("user", "tool")
CONTENT_PART_TYPES = ("text", "image")
_MARK = "\u2063grouprl-between-turns\u2063"  # stands for an assistant turn while the template renders around it


@dataclass
class BetweenTurns:
    """What goes between two policy turns: ``ids`` (template tokens, observation text, image
    placeholders expanded), the processor's non-token ``model_inputs`` for the images among them
    (empty without images) and the ``images`` themselves (RGB, in the order of their placeholders)."""

    ids: list[int]
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    images: list[Image.Image] = field(default_factory=list)


def between_turns(processor, messages: list[dict], *, after_end_of_turn: bool,
                  chat_template_kwargs: dict | None = None, images_before: int = 0) -> BetweenTurns:
    """The tokens the chat template writes after an assistant turn when ``messages`` follow it.

    ``ids`` = the template's end of the assistant turn (left out when ``after_end_of_turn``: the
    policy sampled it), then ``messages`` (roles ``user`` / ``tool``; content a string or a list
    of ``{"type": "text", "text": ...}`` / ``{"type": "image", "image": PIL image or uint8 array
    HxW / HxWx3}`` parts) as the template renders them, all at once (Qwen's templates gather
    consecutive tool messages into one user block), then the next assistant header.

    The template is rendered around a stand-in assistant turn and only what follows it is
    tokenized, so the policy's own ids are never re-encoded; for one plain user message this is
    ``grouprl.rollout.multiturn.turn_boundary_ids``. With images the text goes through the
    processor with them, which expands each image slot into its placeholder tokens (one per
    merged patch). ``images_before``: images already in the dialogue, so that a template that
    numbers pictures (Qwen-VL's ``add_vision_id``) goes on counting from them.

    Raises ValueError naming the message (and part): a role other than user/tool, an unknown
    content part, an image a text-only tokenizer cannot take or that is not an image, a template
    that writes the assistant turn other than once or leaves out an image.
    """
    multimodal = is_multimodal_processor(processor)
    rendered_messages, images = _observation_messages(processor, messages, multimodal)
    renderer = processor if getattr(processor, "chat_template", None) else tokenizer_of(processor)
    tokenizer = tokenizer_of(processor)
    # How the template renders the turns before the stand-in does not matter (the dialogue keeps the
    # ids it has), and may change once a user turn follows: Qwen3 writes an empty <think></think>
    # block into the last assistant turn only. Earlier images only count, for templates that number them.
    first: Any = "x"
    if images_before:
        first = [{"type": "image"}] * images_before + [{"type": "text", "text": "x"}]
    conversation = [{"role": "user", "content": first}, {"role": "assistant", "content": _MARK}, *rendered_messages]
    rendered = renderer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                            **(chat_template_kwargs or {}))
    if rendered.count(_MARK) != 1:
        raise ValueError(f"the chat template writes an assistant turn's content {rendered.count(_MARK)} time(s), "
                         "not once, so the text between two turns cannot be cut out of it")
    tail = rendered.split(_MARK, 1)[1]
    end_token = tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer))
    if after_end_of_turn and end_token and tail.startswith(end_token):
        tail = tail[len(end_token):]
    if not images:
        return BetweenTurns(tokenizer(tail, add_special_tokens=False)["input_ids"])
    slot = getattr(processor, "image_token", None)
    if slot is not None and tail.count(slot) != len(images):
        raise ValueError(f"the chat template wrote {tail.count(slot)} image slot(s) ({slot}) for the {len(images)} "
                         "image(s) of the observation messages; it must render every image part")
    encoded = processor(text=[tail], images=images, return_tensors="pt", add_special_tokens=False)
    ids = encoded["input_ids"][0]
    if "attention_mask" in encoded:
        ids = ids[encoded["attention_mask"][0].bool()]
    inputs = {k: v for k, v in encoded.items() if k not in _PER_TOKEN_KEYS and isinstance(v, torch.Tensor)}
    return BetweenTurns(ids.tolist(), inputs, images)


def append_model_inputs(earlier: dict[str, torch.Tensor], later: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One row's model inputs once more images entered its context: ``cat([earlier[k], later[k]], 0)``
    for each key both have (``pixel_values``, ``image_grid_thw``), a key only one side has kept.

    Qwen-VL matches images to placeholder runs by order: the vision tower encodes the rows of
    ``pixel_values`` image after image, their embeddings fill the image tokens of ``input_ids``
    left to right, and ``get_rope_index`` takes the next ``image_grid_thw`` row at each image
    placeholder run it meets. The later images' placeholders come after the earlier ones' in the
    dialogue, so their tensors go after, in order.
    """
    return collate_model_inputs([earlier, later])


def _observation_messages(processor, messages: list[dict], multimodal: bool) -> tuple[list[dict], list[Image.Image]]:
    """``messages`` as the chat template takes them (image parts as bare slots; for a text-only
    tokenizer, text parts joined into one string) and their images in order, as RGB PIL images."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"observation messages must be a non-empty list of chat messages, got {messages!r:.80}")
    out, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"observation message {i}: expected a dict with 'role' and 'content', "
                             f"got {type(message).__name__}")
        role = message.get("role")
        if role not in OBSERVATION_ROLES:
            raise ValueError(f"observation message {i}: role {role!r} is not one of {OBSERVATION_ROLES}")
        content = message.get("content")
        if isinstance(content, str):
            out.append(dict(message))
            continue
        if not isinstance(content, list):
            raise ValueError(f"observation message {i}: content must be a string or a list of parts, "
                             f"got {type(content).__name__}")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"observation message {i}, part {j}: a text part needs a string 'text'")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                if not multimodal:
                    raise ValueError(f"observation message {i} holds an image, but {type(processor).__name__} is a "
                                     "text-only tokenizer; use a vision-language policy or return text")
                images.append(rgb_image(part.get("image"), f"observation message {i}, part {j}"))
                parts.append({"type": "image"})
            else:
                raise ValueError(f"observation message {i}, part {j}: content part type {kind!r} is not one of "
                                 f"{CONTENT_PART_TYPES}")
        if not multimodal:
            # a text model's template takes a message's content as a string (as for the first prompt)
            out.append({**message, "content": "".join(p["text"] for p in parts)})
        else:
            out.append({**message, "content": parts})
    return out, images


def rgb_image(value: Any, where: str) -> Image.Image:
    """A PIL image, or a uint8 array of shape HxW (grey) or HxWx3 (RGB), as an RGB PIL image."""
    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    import numpy as np

    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or not (value.ndim == 2 or (value.ndim == 3 and value.shape[2] == 3)):
            raise ValueError(f"{where}: an image array must be uint8 of shape HxW or HxWx3, got {value.dtype} "
                             f"{value.shape}")
        return Image.fromarray(value).convert("RGB")
    raise ValueError(f"{where}: an image part needs a PIL image or a numpy array under 'image', "
                     f"got {type(value).__name__}")
