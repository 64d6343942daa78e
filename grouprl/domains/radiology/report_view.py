"""EditGRPO's edits in the run report (``grouprl report``): each operation's sentence before and after.

The edit transform (:mod:`grouprl.domains.radiology.edits`) writes ``edit_operations`` (its
operations: type, before, after, sentence index) and ``edit_source`` (the batch row whose
report was edited: the row itself for an in-place edit, another row for a copy) into each
rollout record; this view shows them under the edited completion.
"""

from __future__ import annotations

import html
from typing import Any

from grouprl.report.views import RecordView


def render_edits(record: dict[str, Any]) -> str | None:
    """The record's edit operations as before/after lines; None for a row no edit changed."""
    operations = record.get("edit_operations")
    if not isinstance(operations, list) or not operations:
        return None
    source = record.get("edit_source")
    where = "" if source is None else f" (edited from row {int(source) + 1} of the step's batch)"
    rows = []
    for op in operations:
        if not isinstance(op, dict):
            continue
        sentence = op.get("sentence_index")
        rows.append(f'<tr><td>{html.escape(str(op.get("type", "?")))}'
                    f'{"" if sentence is None else f" (sentence {int(sentence) + 1})"}</td>'
                    f'<td class="before">{html.escape(str(op.get("before") or ""))}</td>'
                    f'<td class="after">{html.escape(str(op.get("after") or ""))}</td></tr>')
    return (f'<details class="view edit" open><summary>EditGRPO edit: {len(rows)} operation'
            f'{"s" if len(rows) != 1 else ""}{where}</summary><table><tr><th>operation</th><th>before</th>'
            f'<th>after</th></tr>{"".join(rows)}</table></details>')


EDIT_VIEW = RecordView(("edit_operations", "edit_source"), render_edits)
