"""Which rows a RadVLM task reward scores, and how its errors name a row.

RadVLM's instruction data mixes tasks (report, classification, grounding,
conversation) in one LLaVA file. A record may say its task in a ``task`` field; each
task reward scores the rows of its own tasks and returns None (not applicable) for
the others, so several task rewards can share one training set.
"""

from __future__ import annotations

from typing import Any, Sequence


def applies(task_column: Sequence[Any] | None, row: int, tasks: frozenset[str]) -> bool:
    """A row without a ``task`` column (or with it empty) is scored; one of another task is not."""
    if task_column is None or row >= len(task_column) or task_column[row] in (None, ""):
        return True
    return str(task_column[row]) in tasks


def row_name(columns: dict[str, Any], row: int) -> str:
    """``row 3 (id 'cxr-0-00003')`` when the rows have ids, else ``row 3``."""
    ids = columns.get("id")
    if isinstance(ids, (list, tuple)) and row < len(ids) and ids[row] is not None:
        return f"row {row} (id {str(ids[row])!r})"
    return f"row {row}"
