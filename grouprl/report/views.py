"""Views of rollout record fields for the run report, by name: the core's and those domains register.

A rollout record (one line of rollouts.jsonl) has the fields every trainer writes (prompt,
response, rewards, score, advantage) and fields that a part of a run adds: a multi-turn
dialogue with its tool calls and results (``dialogue``, core), EditGRPO's edits (``edit_operations``, radiology). The report
shows the common fields itself and asks :data:`RECORD_VIEWS` for the rest: a
:class:`RecordView` names the fields it shows and renders them, as HTML, under the completion.
A field no view claims is shown as a plain ``name: value`` line when it is a short scalar.
"""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from grouprl.registry import Registry


@dataclass(frozen=True)
class RecordView:
    """``fields``: the record fields this view shows (the report shows them nowhere else);
    ``render(record) -> str | None``: an HTML fragment for one record, None when it has nothing
    to show (the fields are absent or empty). Text from the record must go through
    ``html.escape``: the page runs no script of its records."""

    fields: tuple[str, ...]
    render: Callable[[dict[str, Any]], str | None]


def _check_view(name: str, view: Any) -> None:
    if not isinstance(view, RecordView):
        raise TypeError(f"record view {name!r} is {view!r}, not a grouprl.report.views.RecordView")


RECORD_VIEWS: Registry[RecordView] = Registry("record view", error=KeyError, check=_check_view)


def render_dialogue(record: dict[str, Any]) -> str | None:
    """A multi-turn rollout (``grouprl.rollout.multiturn``) turn by turn, with token counts.

    The record's ``dialogue`` is a list of turns ``{"role", "text", "tokens"}``: the policy's
    (``assistant``; its ``tool_calls``, each ``{"type": "function", "function": {"name", "arguments"}}``
    or a malformed call's ``{"error", "text"}``, shown under its text) and the messages between them
    (``tool``: the results of the calls, ``tools`` their names and ``results`` each one's
    ``{"name", "text", "images"}``; ``user``: an environment's, named by ``environment``, the
    verifier's when unnamed, as in dialogues written before environments had names); ``images``:
    images the messages returned to the policy, counted. The summary line says the turns, the
    record's ``tool_calls`` (calls made in the dialogue) when it has them, and its ``stop_reason``.
    """
    turns = record.get("dialogue")
    if not isinstance(turns, list) or not turns:
        return None
    rows = []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            continue
        tokens = turn.get("tokens")
        counts = _images(turn.get("images")) + (f" ({int(tokens)} tokens)" if isinstance(tokens, int) else "")
        text = f'<pre>{html.escape(str(turn.get("text", "")))}</pre>'
        if turn.get("role") == "assistant":
            rows.append(f'<div class="turn policy"><div class="who">turn {i}: policy{counts}</div>{text}'
                        f'{_calls(turn.get("tool_calls"))}</div>')
        elif turn.get("role") == "tool":
            names = [str(n) for n in turn.get("tools") or [] if n]
            who = "tool results" + (f": {html.escape(', '.join(names))}" if names else "")
            rows.append(f'<div class="turn tool"><div class="who">turn {i}: {who}{counts}</div>'
                        f'{_results(turn.get("results")) or text}</div>')
        else:
            env = turn.get("environment")
            # the verifier was the only environment before environments were named in the record
            kind = "verifier" if env in (None, "verifier") else "environment"
            who = kind if kind == "verifier" else f"environment {html.escape(str(env))}"
            rows.append(f'<div class="turn {kind}"><div class="who">turn {i}: {who}{counts}</div>{text}</div>')
    calls = record.get("tool_calls")
    stop = record.get("stop_reason")
    head = f"dialogue: {len(rows)} turns"
    if isinstance(calls, int) and not isinstance(calls, bool):
        head += f", {calls} tool call{'' if calls == 1 else 's'}"
    if stop:
        head += f", stopped: {html.escape(str(stop))}"
    return f'<details class="view dialogue" open><summary>{head}</summary>{"".join(rows)}</details>'


def _images(count: Any) -> str:
    """`` (1 image)``, `` (2 images)``; nothing for none."""
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return ""
    return f" ({count} image{'' if count == 1 else 's'})"


def _calls(calls: Any) -> str:
    """A policy turn's tool calls: ``name(arguments as JSON)`` each, a malformed one as its error and text."""
    if not isinstance(calls, list) or not calls:
        return ""
    items = []
    for call in calls:
        if not isinstance(call, dict):
            continue
        function = call.get("function")
        if isinstance(function, dict):
            arguments = json.dumps(function.get("arguments"), ensure_ascii=False)
            items.append(f'<li class="call"><code><span class="tool-name">{html.escape(str(function.get("name")))}'
                         f'</span>(<span class="arguments">{html.escape(arguments)}</span>)</code></li>')
        else:
            items.append(f'<li class="call malformed">malformed call: {html.escape(str(call.get("error", "")))}'
                         f'<pre>{html.escape(str(call.get("text", "")))}</pre></li>')
    return f'<ul class="calls">{"".join(items)}</ul>' if items else ""


def _results(results: Any) -> str:
    """Each tool result under its tool's name, with the images it returned counted."""
    if not isinstance(results, list) or not results:
        return ""
    return "".join(f'<div class="result"><div class="tool-name">{html.escape(str(r.get("name", "")))}'
                   f'{_images(r.get("images"))}</div><pre>{html.escape(str(r.get("text", "")))}</pre></div>'
                   for r in results if isinstance(r, dict))


RECORD_VIEWS.register("dialogue", RecordView(("dialogue", "stop_reason", "spans", "tool_calls"), render_dialogue))
