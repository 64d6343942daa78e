"""Views of rollout record fields for the run report, by name: the core's and those domains register.

A rollout record (one line of rollouts.jsonl) has the fields every trainer writes (prompt,
response, rewards, score, advantage) and fields that a part of a run adds: a multi-turn
dialogue (``dialogue``, core), EditGRPO's edits (``edit_operations``, radiology). The report
shows the common fields itself and asks :data:`RECORD_VIEWS` for the rest: a
:class:`RecordView` names the fields it shows and renders them, as HTML, under the completion.
A field no view claims is shown as a plain ``name: value`` line when it is a short scalar.
"""

from __future__ import annotations

import html
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
    """A multi-turn rollout (``grouprl.rollout.multiturn``: Guided-GRPO's verifier dialogue) turn by
    turn: the policy's turns and the verifier's messages between them, with their token counts."""
    turns = record.get("dialogue")
    if not isinstance(turns, list) or not turns:
        return None
    rows = []
    for i, turn in enumerate(turns, 1):
        if not isinstance(turn, dict):
            continue
        role = "policy" if turn.get("role") == "assistant" else "verifier"
        tokens = turn.get("tokens")
        rows.append(f'<div class="turn {role}"><div class="who">turn {i}: {role}'
                    f'{f" ({int(tokens)} tokens)" if isinstance(tokens, int) else ""}</div>'
                    f'<pre>{html.escape(str(turn.get("text", "")))}</pre></div>')
    stop = record.get("stop_reason")
    head = f"dialogue: {len(rows)} turns" + (f", stopped: {html.escape(str(stop))}" if stop else "")
    return f'<details class="view dialogue" open><summary>{head}</summary>{"".join(rows)}</details>'


RECORD_VIEWS.register("dialogue", RecordView(("dialogue", "stop_reason", "spans"), render_dialogue))
