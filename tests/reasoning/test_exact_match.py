"""The validation metric exact_match: the guided demo's single-turn accuracy, by hand and by name."""

import pytest

from grouprl.config import ConfigError
from grouprl.domains.reasoning.exact_match import answer_right, exact_match
from grouprl.trainer.task_metrics import TASK_METRICS, check_task_metric_names


def test_accuracy_and_format_rate_by_hand():
    reference = "5 + 8 = 13. 13 + 3 = 16. <answer>\\boxed{16}</answer>"
    responses = ["5 + 8 = 13. 13 + 3 = 16. <answer>\\boxed{16}</answer>",  # right
                 "<answer>\\boxed{16.0}</answer>",  # right: the same number
                 "5 + 8 = 13. 13 + 3 = 15. <answer>\\boxed{15}</answer>",  # wrong, in format
                 "16"]  # no final answer: wrong and out of format
    assert [answer_right(r, reference) for r in responses] == [True, True, False, False]
    assert exact_match(responses, [reference] * 4) == {"accuracy": 0.5, "format_rate": 0.75}


def test_a_row_without_a_reference_is_an_error_not_a_wrong_answer():
    with pytest.raises(ValueError, match="row 1 has no reference answer"):
        exact_match(["<answer>\\boxed{1}</answer>"] * 2, ["\\boxed{1}", None])


def test_registered_by_name_for_trainer_val_metrics():
    assert TASK_METRICS.get("exact_match") is exact_match
    check_task_metric_names(["exact_match"])
    with pytest.raises(ConfigError, match="did you mean exact_match"):
        check_task_metric_names(["exact_matches"])
