"""The unit every dataset format is read into."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from PIL import Image


@dataclass
class Sample:
    """One prompt with its reference answer, whatever file format it came from.

    ``messages`` is the prompt in Hugging Face chat format. Text is
    ``{"type": "text", "text": ...}`` and each image slot is ``{"type": "image"}``;
    the i-th image slot is filled by ``images[i]`` (so the number of image slots
    always equals ``len(images)``). A text-only prompt has no image slots.
    ``answer`` is the reference response: the SFT target and what rewards compare
    against. ``columns`` holds the record's other fields; reward functions receive
    them as keyword columns, TRL style. ``source`` and ``index`` say where the
    record came from, for error messages and logs. ``chat_template_kwargs`` are passed to
    the chat template with the messages, on every turn (e.g. ``{"enable_thinking": False}``
    for Qwen3; ``data.chat_template_kwargs``, overridden key by key by the record's own).
    ``record_prompt`` is a TRL record's prompt as written (a string, or conversational
    messages), what TRL's reward functions receive (:meth:`reward_prompt`); None for the
    other formats.
    """

    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    index: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    record_prompt: str | list[dict[str, Any]] | None = None

    @property
    def id(self) -> str:
        return str(self.columns.get("id", f"{self.source}#{self.index}"))

    def prompt_text(self) -> str:
        """The prompt's text with images shown as ``<image>``; for logs and reward functions."""
        parts = []
        for message in self.messages:
            content = message["content"]
            if isinstance(content, str):
                parts.append(content)
                continue
            for item in content:
                parts.append("<image>" if item["type"] == "image" else item["text"])
        return "".join(parts)

    @property
    def conversational(self) -> bool:
        """Whether rewards get this row as TRL's conversational data: its prompt a list of messages."""
        return isinstance(self.record_prompt, list)

    def reward_prompt(self) -> str | list[dict[str, Any]]:
        """The prompt as reward functions receive it: :meth:`prompt_text`, or for a TRL record its
        prompt as TRL passes it (the record's string or messages; with images, every message's
        content as parts and each ``{"type": "image"}`` part holding its image, as TRL's
        ``prepare_multimodal_messages`` makes them)."""
        if self.record_prompt is None:
            return self.prompt_text()
        if not self.conversational or not self.images:
            return copy.deepcopy(self.record_prompt)
        images = iter(self.images)
        return [{"role": m["role"], "content": [{**item, "image": next(images)} if item["type"] == "image"
                                                else dict(item) for item in m["content"]]}
                for m in self.messages]

    def reward_completion(self, text: str) -> str | list[dict[str, str]]:
        """A response to this prompt as reward functions receive it: the text, or for conversational
        data TRL's ``[{"role": "assistant", "content": text}]``."""
        return [{"role": "assistant", "content": text}] if self.conversational else text
