"""EditGRPO's edits in the run report: the radiology plugin registers a view of ``edit_operations``,
which the report finds by name and shows under the edited completion, each operation before and after."""

from __future__ import annotations

import json

from grouprl.report import write_report
from grouprl.report.views import RECORD_VIEWS


def edited_record(**fields) -> dict:
    return {"step": 1, "id": "s1", "group": 0, "prompt": "Describe the study.", "reference": "No effusion.",
            "response": "Small left effusion. No pneumothorax.", "rewards": {"finding_f1": 0.5}, "score": 0.5,
            "advantage": 0.1, "edited": True, **fields}


def test_edit_operations_are_shown_before_and_after(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("trainer: {}\n")
    ops = [{"type": "replace", "before": "Large left effusion.", "after": "Small left effusion.", "sentence_index": 0}]
    records = [edited_record(edit_operations=ops, edit_source=1), edited_record(edit_operations=[], edit_source=None)]
    (run / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(run).read_text()
    assert page.count('class="view edit"') == 1  # the unedited row has no edit view
    assert "EditGRPO edit: 1 operation (edited from row 2 of the step's batch)" in page
    assert ('<tr><td>replace (sentence 1)</td><td class="before">Large left effusion.</td>'
            '<td class="after">Small left effusion.</td></tr>') in page
    assert "edit_source:" not in page  # claimed by the view, not repeated as a plain field


def test_the_edit_view_is_registered_by_the_plugin():
    view = RECORD_VIEWS.get("editgrpo_edits")
    assert view.fields == ("edit_operations", "edit_source")
    assert view.render(edited_record()) is None
