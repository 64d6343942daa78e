"""The validation metric report: the report demo's held-out table as one function, registered by name."""

import pytest

from grouprl.domains.radiology import demo
from grouprl.domains.radiology.report_metrics import report_details, report_metric, report_scores
from grouprl.trainer.task_metrics import TASK_METRICS, Generations, compute_task_metrics

REFS = ["Small left pleural effusion. No pneumothorax.", "Cardiomegaly. No focal consolidation.",
        "No acute cardiopulmonary abnormality."]


def test_registered_as_report_with_every_number_of_the_demo_table():
    assert TASK_METRICS.get("report") is report_metric
    values = report_metric(REFS, REFS)
    assert {key for _, key in demo.TABLE_COLUMNS} <= set(values)
    assert {"chexpert_micro_f1_14", "chexpert_macro_f1_14", "radgraph_f1_partial"} <= set(values)
    assert values["finding_f1_micro"] == 1.0 and values["mean_words"] == pytest.approx(14 / 3)


def test_the_demo_rows_numbers_are_the_metrics_and_the_rest_is_details():
    reports = ["Small left pleural effusion.", "No focal consolidation.", "Large right pneumothorax."]
    row = report_scores(reports, REFS)
    assert row == {**report_metric(reports, REFS), **report_details(reports, REFS)}
    assert 0 < row["finding_f1_micro"] < 1 and 0 <= row["finding_f1_per_sample"] <= 1 and len(row["examples"]) == 3
    rows = [{"completion": c, "reference": r, "prompt": "p", "prompt_index": i, "columns": {}}
            for i, (c, r) in enumerate(zip(reports, REFS))]
    logged = compute_task_metrics(["report"], Generations.from_rows(rows))
    assert logged == {f"report/{k}": v for k, v in report_metric(reports, REFS).items()}


def test_a_row_without_a_reference_is_an_error():
    with pytest.raises(ValueError, match="row 1 has no reference report"):
        report_metric(REFS[:2], [REFS[0], None])
