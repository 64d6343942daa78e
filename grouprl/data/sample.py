"""The unit every dataset format is read into."""

from __future__ import annotations

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
    """

    messages: list[dict[str, Any]]
    images: list[Image.Image] = field(default_factory=list)
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    index: int = 0
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

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
