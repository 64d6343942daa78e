"""Tools for multi-turn rollouts: plain Python functions the policy calls from its text.

A tool is a function with type hints and a docstring; its JSON schema is transformers' own
(``transformers.utils.get_json_schema``), the dict a chat template's ``tools=`` takes. Tools
are referenced like rewards (:func:`grouprl.rewards.registry.get_reward`, whose loading this
module reuses): a name registered with :func:`register_tool`, ``path/to/file.py:function``
or ``module:function``.

Tool calls are parsed from the policy's text in its model family's own format by a parser
from :data:`TOOL_CALL_PARSERS`, picked from the chat template's text
(:func:`parser_for_template`) or named:

- ``hermes`` (Qwen2.5, Qwen3, Hermes): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per message;
- ``llama3_json`` (Llama 3.1 / 3.2): one bare ``{"name": ..., "parameters": {...}}``, possibly
  after ``<|python_tag|>``.

transformers 5.24 has a response-parsing engine (``parse_response`` with a per-model
``response_template``) but ships no template for these families (a tokenizer gets one only from
its hub config; TRL keeps its own for exact template matches), and it raises on the first
malformed call of a message. The parsers here keep every call's fate apart: a malformed call is
a :class:`ToolCallError` value the caller sends back to the policy as text, next to the calls
that parsed.

A :class:`ToolRunner` (one per dialogue) runs a turn's calls: the name must be a tool, the
arguments an object holding the schema's required parameters and no others; each call runs in
its own daemon thread for at most ``ToolLimits.timeout`` seconds (the mechanism of
``worker.reward.timeout``: Python cannot interrupt a blocking function, so a call that timed out
is abandoned and may run on); a tool that raises, times out or is called wrongly gives its error
text (type and message) as its result, counted in :attr:`ToolRunner.errors`, never an
exception. Calls beyond ``ToolLimits.per_turn`` / ``per_dialogue`` are not run and answered
with the limit's text (counted in :attr:`ToolRunner.refused`). Results are chat messages
``{"role": "tool", "name": ..., "content": ...}``, the shape the Qwen and Llama templates render.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from grouprl.registry import Registry
from grouprl.rewards.registry import RewardLoadError, get_reward
from grouprl.rewards.scoring import is_async, start_thread


class ToolLoadError(ValueError):
    """A tool reference that cannot be turned into a tool (unknown name, bad file, no type hints or docstring)."""


def _callable_only(name: str, obj: Any) -> None:
    if not callable(obj):
        raise TypeError(f"tool {name!r} must be a callable, got {type(obj).__name__}")


# ':' is reserved for file.py:function references.
TOOLS: Registry[Callable[..., Any]] = Registry("tool", error=ToolLoadError, check=_callable_only, reserved=":")


def register_tool(name: str, fn: Callable[..., Any] | str | None = None):
    """Register a tool function under ``name``: ``register_tool(name, fn)`` or ``@register_tool(name)``;
    ``fn`` may be a lazy ``"module:function"`` reference."""
    return TOOLS.register(name, fn)


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict:
    """transformers' JSON schema of ``fn`` (``{"type": "function", "function": {...}}``), named ``name``
    when given; a :class:`ToolLoadError` naming the tool when its hints or docstring do not allow one."""
    from transformers.utils import get_json_schema

    label = name or getattr(fn, "__name__", repr(fn))
    try:
        schema = get_json_schema(fn)
    except Exception as exc:  # TypeHintParsingException, DocstringParsingException
        raise ToolLoadError(f"tool {label!r} has no JSON schema (a tool needs type hints on every argument "
                            f"and a Google-style docstring): {exc}") from exc
    if name is not None:
        schema["function"]["name"] = name
    return schema


@dataclass(frozen=True)
class Tool:
    """A function the policy may call, under ``name``, with its JSON schema."""

    name: str
    fn: Callable[..., Any] = field(repr=False)
    schema: dict = field(repr=False, compare=False)

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None) -> "Tool":
        schema = tool_schema(fn, name)
        return cls(schema["function"]["name"], fn, schema)

    @property
    def parameters(self) -> dict:
        return self.schema["function"].get("parameters") or {}


def load_tool(reference: str | Callable[..., Any]) -> Tool:
    """The tool a config reference names (a registered name, ``path/file.py:function``, ``module:function``),
    or a function given as is. A registered tool is called by its registered name."""
    if callable(reference):
        return Tool.from_function(reference)
    try:
        fn = get_reward(reference, registry=TOOLS)
    except RewardLoadError as exc:  # the reward loader's message, with the tool's kind in it
        raise ToolLoadError(str(exc)) from exc
    ref = reference.strip()
    return Tool.from_function(fn, ref if ref in TOOLS else None)


def load_tools(references: Iterable[str | Callable[..., Any]]) -> list[Tool]:
    """:func:`load_tool` for each reference; two tools under one name are an error naming it."""
    tools = [load_tool(r) for r in references]
    counts = Counter(t.name for t in tools)
    twice = sorted(n for n, c in counts.items() if c > 1)
    if twice:
        raise ToolLoadError(f"tool name(s) {', '.join(twice)} given more than once; the policy calls tools by name")
    return tools


# ----------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class ToolCall:
    """A call as the policy wrote it: a name and its arguments (a dict when well formed)."""

    name: str
    arguments: Any

    def as_message_part(self) -> dict:
        """The call as an assistant message's ``tool_calls`` item, the shape chat templates render."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    """A call the policy wrote that could not be parsed: its text and why (sent back to the policy)."""

    text: str
    message: str


@dataclass(frozen=True)
class ParsedResponse:
    """An assistant turn's text split into its prose and its calls (parsed or not), in order."""

    content: str
    calls: list[ToolCall | ToolCallError]


ToolCallParser = Callable[[str], ParsedResponse]
TOOL_CALL_PARSERS: Registry[ToolCallParser] = Registry("tool call parser", error=ToolLoadError)


def register_tool_call_parser(name: str, fn: ToolCallParser | str | None = None):
    """Register ``fn(text) -> ParsedResponse`` as the tool call parser ``name``."""
    return TOOL_CALL_PARSERS.register(name, fn)


def _call_from_json(raw: str, arguments_key: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCallError(raw, f"the tool call is not valid JSON: {exc}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCallError(raw, f'a tool call is a JSON object {{"name": ..., "{arguments_key}": {{...}}}}')
    return ToolCall(obj["name"], obj.get(arguments_key, {}))


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_tool_call_parser("hermes")
def parse_hermes(text: str) -> ParsedResponse:
    """Calls in ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Qwen2.5, Qwen3, Hermes).

    A block left open at the end of the text (the turn cut off) is a malformed call.
    """
    calls: list[ToolCall | ToolCallError] = []
    for match in _HERMES.finditer(text):
        raw = match.group(1).strip()
        if not match.group(0).endswith("</tool_call>"):
            calls.append(ToolCallError(raw, "the <tool_call> block is not closed with </tool_call>"))
        else:
            calls.append(_call_from_json(raw, "arguments"))
    first = text.find("<tool_call>")
    content = (text if first < 0 else text[:first]).strip()
    return ParsedResponse(content, calls)


_PYTHON_TAG = "<|python_tag|>"
_LLAMA_START = re.compile(r'\{\s*"name"\s*:')


@register_tool_call_parser("llama3_json")
def parse_llama3_json(text: str) -> ParsedResponse:
    """One call as a bare ``{"name": ..., "parameters": {...}}`` (Llama 3.1 / 3.2 JSON tool calling),
    the whole message or after ``<|python_tag|>``; text without one is plain content."""
    tagged = text.find(_PYTHON_TAG)
    if tagged >= 0:
        content, raw = text[:tagged].strip(), text[tagged + len(_PYTHON_TAG):].strip()
    else:
        stripped = text.strip()
        if not _LLAMA_START.match(stripped):
            return ParsedResponse(stripped, [])
        content, raw = "", stripped
    if not raw:
        return ParsedResponse(content, [ToolCallError(raw, "<|python_tag|> is followed by no tool call")])
    return ParsedResponse(content, [_call_from_json(raw, "parameters")])


def parser_for_template(chat_template: str | None, name: str | None = None) -> str:
    """The tool call parser's name for a chat template: ``name`` when given (checked), else ``hermes`` for a
    template writing ``<tool_call>``, ``llama3_json`` for one with ``<|python_tag|>`` or the ``ipython`` role;
    a :class:`ToolLoadError` when the template shows neither."""
    if name is not None:
        TOOL_CALL_PARSERS.get(name)  # unknown names fail here, with the known ones
        return name
    text = chat_template or ""
    if "<tool_call>" in text:
        return "hermes"
    if _PYTHON_TAG in text or "ipython" in text:
        return "llama3_json"
    raise ToolLoadError("the chat template shows no tool call format this version parses (<tool_call> or "
                        f"<|python_tag|>); name a parser: {', '.join(TOOL_CALL_PARSERS.names())}")


def parse_tool_calls(text: str, parser: str) -> ParsedResponse:
    """``text`` parsed by the registered parser ``parser``."""
    return TOOL_CALL_PARSERS.get(parser)(text)


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class ToolLimits:
    """``per_turn`` / ``per_dialogue``: calls run at most (None: no limit); ``timeout``: seconds per call."""

    per_turn: int | None = None
    per_dialogue: int | None = None
    timeout: float | None = None

    def __post_init__(self):
        for key in ("per_turn", "per_dialogue"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"tool limit {key} must be None or an int >= 1, got {value!r}")
        if self.timeout is not None and (isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float))
                                         or not self.timeout > 0):
            raise ValueError(f"tool timeout must be None or seconds > 0, got {self.timeout!r}")


@dataclass(frozen=True)
class ToolResult:
    """One call's outcome: the ``tool`` message for the policy, and whether it is an error. ``content``
    is text, or a list of content parts (``{"type": "text" | "image", ...}``) when the tool returned
    parts (an image for a vision-language policy)."""

    name: str
    content: str | list
    error: bool = False

    @property
    def message(self) -> dict:
        return {"role": "tool", "name": self.name, "content": self.content}


def is_content_parts(value: Any) -> bool:
    """Whether a tool's return value is chat content parts (a non-empty list of ``{"type": ...}`` dicts),
    passed to the policy as they are rather than as JSON text (TRL's multimodal tool results)."""
    return isinstance(value, list) and bool(value) and all(isinstance(p, dict) and "type" in p for p in value)


def _argument_problem(tool: Tool, arguments: Any) -> str | None:
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    params = tool.parameters
    known = params.get("properties") or {}
    missing = [p for p in params.get("required") or [] if p not in arguments]
    unknown = [a for a in arguments if a not in known]
    problems = ([f"missing required argument(s) {', '.join(missing)}"] if missing else []) + \
               ([f"unknown argument(s) {', '.join(unknown)} (takes: {', '.join(known) or 'none'})"] if unknown else [])
    return "; ".join(problems) or None


class ToolRunner:
    """Runs one dialogue's tool calls under :class:`ToolLimits`, counting calls, errors and refusals."""

    def __init__(self, tools: Iterable[Tool], limits: ToolLimits = ToolLimits()):
        self.tools = {t.name: t for t in tools}
        self.limits = limits
        self.calls = 0  # calls run (a tool's function entered), over the dialogue
        self.errors = 0  # calls answered with an error: malformed, unknown tool, bad arguments, raised, timed out
        self.refused = 0  # calls over a limit, not run
        # calls not refused, run or not: a malformed call or a wrong one uses up the limits too, else a
        # policy writing bad calls would never reach them
        self.attempted = 0
        self.per_tool: Counter[str] = Counter()  # calls run, by tool name

    def run_turn(self, calls: Iterable[ToolCall | ToolCallError]) -> list[ToolResult]:
        """The results of one assistant turn's calls, in order (one per call, errors included)."""
        results = []
        this_turn = 0
        for call in calls:
            name = call.name if isinstance(call, ToolCall) else "error"
            over = self._over_limit(this_turn)
            if over:
                self.refused += 1
                results.append(ToolResult(name, f"Error: not run: {over}", error=True))
                continue
            this_turn += 1
            self.attempted += 1
            result = self._run(call)
            self.errors += result.error
            results.append(result)
        return results

    def _over_limit(self, this_turn: int) -> str | None:
        lim = self.limits
        if lim.per_turn is not None and this_turn >= lim.per_turn:
            return f"at most {lim.per_turn} tool call(s) per turn"
        if lim.per_dialogue is not None and self.attempted >= lim.per_dialogue:
            return f"at most {lim.per_dialogue} tool call(s) per dialogue"
        return None

    def _run(self, call: ToolCall | ToolCallError) -> ToolResult:
        if isinstance(call, ToolCallError):
            return ToolResult("error", f"Error: malformed tool call: {call.message}", error=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(call.name, f"Error: unknown tool {call.name!r} (tools: "
                                         f"{', '.join(sorted(self.tools)) or 'none'})", error=True)
        problem = _argument_problem(tool, call.arguments)
        if problem:
            return ToolResult(call.name, f"Error: wrong arguments for {call.name}: {problem}", error=True)
        self.calls += 1
        self.per_tool[call.name] += 1
        try:
            value = self._call(tool, call.arguments)
        except Exception as exc:  # the policy reads what went wrong; the rollout goes on
            return ToolResult(call.name, f"Error: {type(exc).__name__}: {exc}", error=True)
        if is_content_parts(value):
            return ToolResult(call.name, list(value))
        return ToolResult(call.name, value if isinstance(value, str) else json.dumps(value, default=str))

    def _call(self, tool: Tool, arguments: dict) -> Any:
        fn: Callable[..., Any] = tool.fn
        if is_async(fn):
            coroutine_fn = fn
            fn = lambda **kw: asyncio.run(coroutine_fn(**kw))  # noqa: E731 - its own loop in its own thread
        if self.limits.timeout is None:
            return fn(**arguments)
        future = start_thread(fn, [], dict(arguments), f"tool-{tool.name}")
        # wait(), not result(timeout): a TimeoutError the tool raises itself is its own error
        concurrent.futures.wait([future], timeout=self.limits.timeout)
        if not future.done():
            raise TimeoutError(f"no result within {self.limits.timeout:g} s; the call was abandoned")
        return future.result()
