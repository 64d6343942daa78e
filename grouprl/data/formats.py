"""The seeds' record formats and how one record becomes the parts of a Sample.

Four formats are read as they are found in the seeds' data and TRL's:

- ``easyr1``: ``{"problem": str, "answer": str, "images": [...]}``; the key
  names are configurable (``prompt_key``, ``answer_key``, ``image_key``).
- ``llava``: ``{"image": path | [paths], "conversations": [{"from": "human" |
  "gpt" | "system", "value": str}, ...]}``.
- ``swift`` (ms-swift): ``{"messages": [{"role", "content"}], "images": [...],
  "solution": str}``.
- ``trl``: TRL's prompt datasets, ``{"prompt": str | [messages], "completion": str |
  [messages]?, "images": [...]? | "image": ...?, ...}``: standard (text) or
  conversational (``{"role", "content"}`` messages, content a string or parts
  ``{"type": "text", "text": ...}`` / ``{"type": "image"}``), prompt-only or
  prompt-completion. The completion (else a string ``answer`` field) is the reference
  answer; every other field (``solution``, ...) is a column under its own name. Images
  without a ``{"type": "image"}`` part go before the first user message's text, as
  TRL puts them. The prompt as written is kept for rewards (``Sample.record_prompt``):
  they receive it, and for a conversational one each completion as
  ``[{"role": "assistant", "content": text}]``, as TRL's rewards do.

For conversations, a final ``gpt`` / ``assistant`` turn is the reference answer
and the turns before it are the prompt (earlier assistant turns stay in the
prompt as history). Without a final assistant turn the whole conversation is the
prompt; ms-swift records then take the answer from ``solution``.

Functions here only look at the record; opening image files is left to the
loader, which knows where the record came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("easyr1", "llava", "swift", "trl")
IMAGE_PLACEHOLDER = "<image>"

_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_SWIFT_ROLES = ("system", "user", "assistant")
_TRL_CONSUMED = ("prompt", "completion", "images", "image")


class DataError(ValueError):
    """A dataset that cannot be read; the message names the file, the record and the field."""


class RecordError(Exception):
    """A problem with one field of one record; the loader adds the file and record index."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


@dataclass(frozen=True)
class RecordKeys:
    """Field names of EasyR1 records (its ``data.prompt_key`` / ``answer_key`` / ``image_key``)."""

    prompt: str = "problem"
    answer: str = "answer"
    images: str = "images"


@dataclass
class ParsedRecord:
    """A record taken apart: the prompt messages, image values still unopened, the answer, other fields.

    ``images`` pairs each raw image value with the field it came from
    (``"images[1]"``) so that a missing file can be reported by field.
    ``record_prompt``: a TRL record's prompt in its own form, for rewards (None otherwise).
    """

    messages: list[dict[str, Any]]
    images: list[tuple[str, Any]] = field(default_factory=list)
    answer: str | None = None
    columns: dict[str, Any] = field(default_factory=dict)
    record_prompt: str | list[dict[str, Any]] | None = None


def format_signatures(keys: RecordKeys) -> dict[str, tuple[str, ...]]:
    """Each format's fields, the first one being what identifies it."""
    return {
        "easyr1": (keys.prompt, keys.answer, keys.images),
        "llava": ("conversations", "image"),
        "swift": ("messages", "images", "solution"),
        "trl": ("prompt", "completion", "images"),
    }


def detect_format(record: dict[str, Any], keys: RecordKeys, source: str) -> str:
    """The format whose identifying field the record has; an error if none or several do."""
    signatures = format_signatures(keys)
    matches = [name for name, fields in signatures.items() if record.get(fields[0]) is not None]
    if set(matches) == {"easyr1", "trl"}:
        # EasyR1's prompt key set to "prompt": a text prompt is EasyR1's, a list of messages TRL's
        matches = ["trl" if isinstance(record.get("prompt"), list) else "easyr1"]
    if len(matches) == 1:
        return matches[0]
    expected = "; ".join(
        f"{name}: {', '.join(repr(f) for f in fields)} ({fields[0]!r} required)" for name, fields in signatures.items()
    )
    if matches:
        problem = f"the first record fits several formats ({', '.join(matches)})"
    else:
        problem = "cannot detect the record format from the first record"
    raise DataError(
        f"{source}: {problem}; keys found: {sorted(record)}; formats expect: {expected}. "
        f"Set the data format option to one of {', '.join(FORMATS)}."
    )


def parse_record(
    record: dict[str, Any],
    fmt: str,
    *,
    keys: RecordKeys = RecordKeys(),
    system_prompt: str | None = None,
    format_prompt: Callable[[str], str] | None = None,
    require_answer: bool = True,
) -> ParsedRecord:
    """Take one record of format ``fmt`` apart; raises RecordError naming the bad field.

    ``format_prompt`` (from ``prompt_formatter``) rewrites the text of the user turn the policy
    answers (the last one), before its ``<image>`` slots are split out, as EasyR1 does."""
    if fmt == "easyr1":
        parsed = _parse_easyr1(record, keys, require_answer, format_prompt)
        prompt_field, image_field = keys.prompt, keys.images
    elif fmt == "llava":
        parsed = _parse_llava(record, require_answer, format_prompt)
        prompt_field, image_field = "conversations", "image"
    elif fmt == "swift":
        parsed = _parse_swift(record, require_answer, format_prompt)
        prompt_field, image_field = "messages", "images"
    elif fmt == "trl":
        # TRL's prompt-only datasets have no reference (rewards read their own columns): never required
        parsed = _parse_trl(record, format_prompt)
        prompt_field, image_field = "prompt", "images" if record.get("images") is not None else "image"
    else:
        raise DataError(f"unknown record format {fmt!r}; valid formats: auto, {', '.join(FORMATS)}")
    _reconcile_image_slots(parsed, prompt_field, image_field)
    if system_prompt is not None and not any(m["role"] == "system" for m in parsed.messages):
        # A system turn written in the record is more specific than the run's default.
        parsed.messages.insert(0, {"role": "system", "content": [{"type": "text", "text": system_prompt}]})
        if isinstance(parsed.record_prompt, list):  # rewards see the prompt the policy answered
            parsed.record_prompt.insert(0, {"role": "system", "content": system_prompt})
    # TRL-style reward functions read the reference as the ``answer`` column.
    parsed.columns["answer"] = parsed.answer
    return parsed


def split_placeholders(text: str) -> list[dict[str, Any]]:
    """Chat content items for ``text``: text pieces with an image slot at each ``<image>``."""
    items: list[dict[str, Any]] = []
    for i, piece in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if i > 0:
            items.append({"type": "image"})
        if piece:
            items.append({"type": "text", "text": piece})
    return items


def prompt_formatter(template: str) -> Callable[[str], str]:
    """``text -> template.render(content=text)`` for a Jinja template, stripped as EasyR1 strips it
    (EasyR1's ``data.format_prompt`` files, e.g. ``{{ content | trim }} You FIRST think ...``).

    A template that does not parse is a DataError naming its line; one that renders nothing
    from ``content`` would silently replace every prompt, so it is refused too."""
    import jinja2

    try:
        compiled = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(template.strip())
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(f"format_prompt template: {exc.message} (line {exc.lineno})") from exc
    probe = "\x00grouprl-probe\x00"
    try:
        uses_content = probe in compiled.render(content=probe)
    except jinja2.UndefinedError as exc:
        raise DataError(f"format_prompt template: {exc.message}; templates get one variable, 'content'") from exc
    if not uses_content:
        raise DataError("format_prompt template never renders {{ content }}, so every prompt would be replaced")
    return lambda text: compiled.render(content=text)


def _format_last_user_turn(messages: list[dict[str, str]], format_prompt: Callable[[str], str] | None) -> None:
    if format_prompt is None:
        return
    for message in reversed(messages):
        if message["role"] == "user":
            message["text"] = format_prompt(message["text"])
            return


def _parse_easyr1(record: dict[str, Any], keys: RecordKeys, require_answer: bool,
                  format_prompt: Callable[[str], str] | None = None) -> ParsedRecord:
    prompt = _string_field(record, keys.prompt)
    if format_prompt is not None:
        prompt = format_prompt(prompt)
    answer = _answer_field(record, keys.answer, require_answer)
    images = _image_list(record, keys.images)
    messages = [{"role": "user", "content": split_placeholders(prompt)}]
    columns = _other_fields(record, (keys.prompt, keys.images))
    return ParsedRecord(messages, images, answer, columns)


def _parse_llava(record: dict[str, Any], require_answer: bool,
                 format_prompt: Callable[[str], str] | None = None) -> ParsedRecord:
    turns = _list_field(record, "conversations")
    messages = []
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RecordError(where, f"expected an object with 'from' and 'value', got {type(turn).__name__}")
        speaker = turn.get("from")
        if not isinstance(speaker, str) or speaker not in _LLAVA_ROLES:
            raise RecordError(f"{where}.from", f"expected one of {sorted(_LLAVA_ROLES)}, got {speaker!r}")
        messages.append({"role": _LLAVA_ROLES[speaker], "text": _string_field(turn, "value", where)})
    images = _image_value_or_list(record, "image")
    answer = _split_final_answer(messages, "conversations", "no final 'gpt' turn to use as the answer", require_answer)
    _format_last_user_turn(messages, format_prompt)
    columns = _other_fields(record, ("conversations", "image"))
    return ParsedRecord(_to_chat(messages, "conversations"), images, answer, columns)


def _parse_swift(record: dict[str, Any], require_answer: bool,
                 format_prompt: Callable[[str], str] | None = None) -> ParsedRecord:
    raw = _list_field(record, "messages")
    messages = []
    for i, message in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RecordError(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str) or role not in _SWIFT_ROLES:
            raise RecordError(f"{where}.role", f"expected one of {list(_SWIFT_ROLES)}, got {role!r}")
        messages.append({"role": role, "text": _string_field(message, "content", where)})
    # ms-swift datasets write a list under `images`; some (CheXPO's) a single path under `image`
    if record.get("images") is None and record.get("image") is not None:
        images = _image_value_or_list(record, "image")
    else:
        images = _image_list(record, "images")
    # The solution is only needed when there is no final assistant message.
    has_final = bool(messages) and messages[-1]["role"] == "assistant"
    solution = None if has_final else _answer_field(record, "solution", required=False)
    answer = _split_final_answer(messages, "messages", None, required=False)
    if answer is None:
        answer = solution
        if answer is None and require_answer:
            raise RecordError("messages", "no final assistant message and no 'solution' field to use as the answer")
    _format_last_user_turn(messages, format_prompt)
    columns = _other_fields(record, ("messages", "images", "image"))
    return ParsedRecord(_to_chat(messages, "messages"), images, answer, columns)


def _parse_trl(record: dict[str, Any], format_prompt: Callable[[str], str] | None = None) -> ParsedRecord:
    prompt = record.get("prompt")
    if isinstance(prompt, str):
        if format_prompt is not None:
            prompt = format_prompt(prompt)
        messages = [{"role": "user", "content": [{"type": "text", "text": prompt}] if prompt else []}]
        record_prompt: str | list[dict[str, Any]] = prompt
    elif isinstance(prompt, list) and prompt:
        record_prompt = [_trl_message(message, f"prompt[{i}]") for i, message in enumerate(prompt)]
        if format_prompt is not None:
            _format_trl_user_turn(record_prompt, format_prompt)
        messages = [{"role": m["role"], "content": _trl_parts(m["content"])} for m in record_prompt]
        if not any(m["role"] == "user" for m in messages):
            raise RecordError("prompt", "the prompt has no user message")
    elif prompt is None:
        raise RecordError("prompt", f"missing (keys present: {sorted(record)})")
    else:
        raise RecordError("prompt", "expected a string (standard) or a non-empty list of messages (conversational), "
                          f"got {_describe(prompt)}")
    answer = _trl_completion(record.get("completion"))
    own = record.get("answer")
    if own is not None:
        if not isinstance(own, str):
            raise RecordError("answer", f"expected a string (the reference answer rewards receive as 'answer'), "
                              f"got {type(own).__name__}")
        if answer is not None and own != answer:
            raise RecordError("answer", "differs from 'completion', which is this record's reference answer "
                              "(what rewards receive as 'answer'); rename one of them")
        answer = own
    if record.get("images") is None and record.get("image") is not None:
        images = _image_value_or_list(record, "image")  # TRL's single-image column
    else:
        images = _image_list(record, "images")
    columns = _other_fields(record, _TRL_CONSUMED)
    return ParsedRecord(messages, images, answer, columns, record_prompt=record_prompt)


def _trl_message(message: Any, where: str) -> dict[str, Any]:
    """A TRL message as written (role, content), checked; other keys are dropped."""
    if not isinstance(message, dict):
        raise RecordError(where, f"expected an object with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or role not in _SWIFT_ROLES:
        raise RecordError(f"{where}.role", f"expected one of {list(_SWIFT_ROLES)}, got {role!r}")
    content = message.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise RecordError(f"{where}.content", f"expected a string or a list of parts, got {_describe(content)}")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise RecordError(f"{at}.text", f"expected a string, got {_describe(part.get('text'))}")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            if part.get("image") is not None:
                raise RecordError(f"{at}.image", "images go in the record's 'images' (or 'image') field; a "
                                  "{'type': 'image'} part marks where each one goes")
            parts.append({"type": "image"})
        else:
            raise RecordError(at, f"expected a part {{'type': 'text', 'text': ...}} or {{'type': 'image'}}, "
                              f"got {part!r}")
    return {"role": role, "content": parts}


def _trl_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat content items of a checked TRL message's content (no ``<image>`` splitting: TRL has none)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if content else []
    return [dict(part) for part in content]


def _format_trl_user_turn(messages: list[dict[str, Any]], format_prompt: Callable[[str], str]) -> None:
    """``format_prompt`` on the last user message's text (its last text part)."""
    for message in reversed(messages):
        if message["role"] != "user":
            continue
        if isinstance(message["content"], str):
            message["content"] = format_prompt(message["content"])
            return
        for part in reversed(message["content"]):
            if part["type"] == "text":
                part["text"] = format_prompt(part["text"])
                return
        return


def _trl_completion(completion: Any) -> str | None:
    """The reference text of a TRL ``completion``: the string, or its last message's (an assistant's) text."""
    if completion is None or isinstance(completion, str):
        return completion
    if not isinstance(completion, list) or not completion:
        raise RecordError("completion", "expected a string (standard) or a non-empty list of messages "
                          f"(conversational), got {_describe(completion)}")
    last = _trl_message(completion[-1], f"completion[{len(completion) - 1}]")
    if last["role"] != "assistant":
        raise RecordError(f"completion[{len(completion) - 1}].role",
                          f"the completion's last message must be the assistant's, got {last['role']!r}")
    content = last["content"]
    if isinstance(content, str):
        return content
    if any(part["type"] == "image" for part in content):
        raise RecordError(f"completion[{len(completion) - 1}].content", "a reference answer cannot hold an image")
    return "".join(part["text"] for part in content)


def _describe(value: Any) -> str:
    return "an empty list" if value == [] else type(value).__name__


def _split_final_answer(
    messages: list[dict[str, str]], field_name: str, missing: str | None, required: bool
) -> str | None:
    """Pop a final assistant turn off ``messages`` and return its text."""
    if messages and messages[-1]["role"] == "assistant":
        return messages.pop()["text"]
    if required:
        raise RecordError(field_name, missing or "no final assistant turn to use as the answer")
    return None


def _to_chat(messages: list[dict[str, str]], field_name: str) -> list[dict[str, Any]]:
    if not any(m["role"] == "user" for m in messages):
        raise RecordError(field_name, "the prompt has no user turn")
    return [{"role": m["role"], "content": split_placeholders(m["text"])} for m in messages]


def _reconcile_image_slots(parsed: ParsedRecord, prompt_field: str, image_field: str) -> None:
    """Make the number of image slots in the prompt equal the number of images.

    Prompts without ``<image>`` get one slot per image at the start of the first
    user turn (where EasyR1 and LLaVA put them); any other mismatch means the
    record does not say which image goes where, so it is an error.
    """
    slots = sum(item["type"] == "image" for m in parsed.messages for item in m["content"])
    n_images = len(parsed.images)
    if slots == 0 and n_images:
        first_user = next(m for m in parsed.messages if m["role"] == "user")
        first_user["content"][:0] = [{"type": "image"} for _ in range(n_images)]
    elif slots != n_images:
        raise RecordError(
            prompt_field,
            f"{slots} {IMAGE_PLACEHOLDER} placeholder{'s' if slots != 1 else ''} but {n_images} "
            f"image{'s' if n_images != 1 else ''} in {image_field!r}",
        )
    if not any(m["content"] for m in parsed.messages if m["role"] == "user"):
        raise RecordError(prompt_field, "the prompt is empty (no text and no images)")


def _string_field(record: dict[str, Any], key: str, parent: str | None = None) -> str:
    where = f"{parent}.{key}" if parent else key
    value = record.get(key)
    if value is None:
        raise RecordError(where, f"missing (keys present: {sorted(record)})")
    if not isinstance(value, str):
        raise RecordError(where, f"expected a string, got {type(value).__name__}")
    return value


def _answer_field(record: dict[str, Any], key: str, required: bool) -> str | None:
    if record.get(key) is None and not required:
        return None
    return _string_field(record, key)


def _list_field(record: dict[str, Any], key: str) -> list[Any]:
    value = record.get(key)
    if value is None:
        raise RecordError(key, f"missing (keys present: {sorted(record)})")
    if not isinstance(value, list):
        raise RecordError(key, f"expected a list, got {type(value).__name__}")
    if not value:
        raise RecordError(key, "is empty")
    return value


def _image_list(record: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    """``images`` must be a list; absent or null means a text-only record."""
    value = record.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise RecordError(key, f"expected a list of images, got {type(value).__name__}")
    return [(f"{key}[{i}]", item) for i, item in enumerate(value)]


def _image_value_or_list(record: dict[str, Any], key: str) -> list[tuple[str, Any]]:
    """LLaVA's ``image`` is one path or a list of them."""
    value = record.get(key)
    if value is None:
        return []
    if isinstance(value, list):
        return [(f"{key}[{i}]", item) for i, item in enumerate(value)]
    return [(key, value)]


def _other_fields(record: dict[str, Any], consumed: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in consumed}
