"""Task metrics (grouprl.trainer.task_metrics): names checked before the model loads, the contract,
errors that name the metric, and in a tiny GRPO run, val/<name>/<key> computed on the whole validation set."""

from __future__ import annotations

import json
import math

import pytest

from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer.metrics import StepMetrics
from grouprl.trainer.task_metrics import (TASK_METRICS, Generations, TaskMetricError, compute_task_metrics,
                                          record_task_metrics)


def pooled_hits(completions, references, *, prompts, prompt_index, **columns):
    """A corpus-level metric: characters of the reference found, pooled over every response (not a mean of
    per-response shares), and the number of rows, prompts and rows of each data source seen."""
    hits = sum(len(r) for c, r in zip(completions, references) if r and r in c)
    total = sum(len(r) for r in references if r)
    return {"pooled": hits / total, "rows": len(completions), "prompts": len(set(prompt_index)),
            "even_rows": sum(s == "even" for s in columns.get("data_source", []))}


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(TASK_METRICS, "pooled_hits", pooled_hits)
    return "pooled_hits"


def test_an_unknown_name_is_a_config_error_naming_the_key_and_the_closest_names(say_task, tmp_path, registered):
    cfg = say_task(2).config(tmp_path / "run", [{"name": "accuracy"}], **{"trainer.val_metrics": ["pooled_hit"],
                                                                        "worker.actor.global_batch_size": 4})
    with pytest.raises(ConfigError, match=r"'trainer.val_metrics'.*'pooled_hit'.*did you mean pooled_hits"):
        config_from_dict(cfg)
    cfg["trainer"]["val_metrics"] = ["pooled_hits", "pooled_hits"]
    with pytest.raises(ConfigError, match="trainer.val_metrics' names pooled_hits more than once"):
        config_from_dict(cfg)
    cfg["trainer"]["val_metrics"] = ["pooled_hits"]
    assert config_from_dict(cfg).trainer.val_metrics == ["pooled_hits"]


def test_names_that_would_collide_with_the_reward_metrics_are_refused():
    with pytest.raises(ValueError, match="taken by the reward metrics"):
        TASK_METRICS.register("reward", pooled_hits)
    with pytest.raises(ValueError, match="may not contain '/'"):
        TASK_METRICS.register("a/b", pooled_hits)


def rows_out_of_order():
    # two processes' rows concatenated: process 0 held prompts 0 and 2, process 1 prompt 1
    return [{"completion": c, "reference": "ab", "prompt": f"p{i}", "prompt_index": i, "columns": {"data_source": s}}
            for c, i, s in (("ab", 0, "even"), ("x", 0, "even"), ("ab", 2, "even"), ("ab", 1, "odd"), ("b", 1, "odd"))]


def test_rows_are_put_back_in_dataset_order_and_the_metric_sees_the_whole_set(registered):
    generations = Generations.from_rows(rows_out_of_order())
    assert generations.prompt_index == [0, 0, 1, 1, 2] and generations.completions == ["ab", "x", "ab", "b", "ab"]
    values = compute_task_metrics([registered], generations)
    assert values == {"pooled_hits/pooled": 6 / 10, "pooled_hits/rows": 5.0, "pooled_hits/prompts": 3.0,
                      "pooled_hits/even_rows": 3.0}


@pytest.mark.parametrize("result, message", [
    (RuntimeError("labeler down"), r"validation metric 'broken' \(trainer.val_metrics\) failed on 5 responses: "
                                   r"RuntimeError: labeler down"),
    ([0.5], "returned list, not a mapping"),
    ({"f1": "0.5"}, r"returned 'f1' = '0.5': values are numbers"),
    ({"f1": None}, r"returned 'f1' = None: values are numbers"),
])
def test_a_failing_metric_is_an_error_naming_it_never_a_zero(monkeypatch, result, message):
    def broken(completions, references, **columns):
        if isinstance(result, Exception):
            raise result
        return result

    monkeypatch.setitem(TASK_METRICS, "broken", broken)
    with pytest.raises(TaskMetricError, match=message):
        compute_task_metrics(["broken"], Generations.from_rows(rows_out_of_order()))


def test_recorded_values_reduce_to_themselves_and_nan_stays_nan():
    metrics = StepMetrics()
    record_task_metrics(metrics, {"m/f1": 0.25, "m/none": math.nan})
    values = metrics.local()
    assert values["m/f1"] == 0.25 and math.isnan(values["m/none"])


def test_grpo_run_logs_task_metrics_on_the_whole_validation_set(say_task, tmp_path, registered):
    task = say_task(6)
    records = [json.loads(line) for line in task.data.read_text().splitlines()][:5]
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({**r, "data_source": "even" if i % 2 == 0 else "odd"}) + "\n"
                           for i, r in enumerate(records)))
    from grouprl.trainer.grpo import GRPOTrainer

    # val_batch_size 2: the validation set comes in three batches, the metric sees all of them at once
    cfg = task.config(tmp_path / "run", [{"name": "accuracy"}], **{
        "data.val_files": [str(val)], "data.val_batch_size": 2, "trainer.max_steps": 1, "trainer.val_freq": 1,
        "trainer.val_generations_to_log": 100, "trainer.val_metrics": [registered],
        "worker.rollout.val_n": 2, "worker.rollout.val_temperature": 1.0, "worker.actor.global_batch_size": 4})
    GRPOTrainer(config_from_dict(cfg)).train()
    run = tmp_path / "run"
    val_line = next(json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "val/reward/mean" in x)
    generations = [json.loads(x) for x in (run / "val_generations.jsonl").read_text().splitlines()]
    assert len(generations) == 10
    hits = sum(len(g["reference"]) for g in generations if g["reference"] in g["response"])
    expected = hits / sum(len(g["reference"]) for g in generations)
    assert val_line["val/pooled_hits/pooled"] == pytest.approx(expected, abs=1e-12)
    assert (val_line["val/pooled_hits/rows"], val_line["val/pooled_hits/prompts"],
            val_line["val/pooled_hits/even_rows"]) == (10, 5, 6)
    schema = json.loads((run / "metrics_schema.json").read_text())
    assert schema["val/pooled_hits/pooled"] == "mean"
    assert not any("pooled" in g for g in generations)  # metrics.jsonl only
