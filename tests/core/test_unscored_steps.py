"""A step in which no reward applies to any row trains on nothing: counted, warned about once, or
(``trainer.fail_on_unscored_steps``) the run stops with one line naming the rewards."""

from __future__ import annotations

import logging

import pytest
import yaml

from grouprl.cli import main

REWARDS = '''
def never(prompts, completions, **columns):
    return [None] * len(completions)


def every_other(prompts, completions, **columns):
    return [None if i % 2 else 1.0 for i in range(len(completions))]
'''

WARNING = "no row was scored"


@pytest.fixture(scope="module")
def task(say_task):
    return say_task(6)


@pytest.fixture
def write_run(task, tmp_path):
    """``write_run(*functions, **overrides) -> (config path, run dir)``: a 3-step run scored by the
    named functions of ``REWARDS``, as a YAML file for ``grouprl train``."""
    (tmp_path / "rewards.py").write_text(REWARDS)

    def write(*functions, **overrides):
        run = tmp_path / "run"
        specs = [{"name": f"{tmp_path / 'rewards.py'}:{f}"} for f in functions]
        values = task.config(run, specs, **{"trainer.max_steps": 3, "worker.actor.global_batch_size": 4, **overrides})
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(values))
        return path, run

    return write


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and WARNING in r.getMessage()]


def test_a_reward_that_never_applies_is_warned_about_once_and_counted(write_run, read_jsonl, caplog, capsys):
    path, run = write_run("never")
    assert main(["train", str(path)]) == 1  # the default: the run goes on, and fails at its end
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"grouprl: reward error: no row of any step was scored (steps 1-3; no reward "
                                            f"applied: {path.parent / 'rewards.py'}:never): the run trained on nothing")
    assert (run / "checkpoints" / "global_step_3").is_dir()  # it ran to its end and saved
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert sum(m["reward/unscored_steps"] for m in metrics) == 3
    assert all(m["reward/unscored_rows"] == 16 for m in metrics)
    warned = warnings_of(caplog)
    assert len(warned) == 1, warned
    assert "step 1" in warned[0] and "rewards.py:never" in warned[0]


def test_a_reward_that_applies_to_some_rows_is_not_an_unscored_step(write_run, read_jsonl, caplog):
    path, run = write_run("every_other", **{"trainer.fail_on_unscored_steps": True})
    assert main(["train", str(path)]) == 0
    metrics = read_jsonl(run / "metrics.jsonl")
    assert [m["reward/unscored_steps"] for m in metrics] == [0, 0, 0]
    assert all(m["reward/unscored_rows"] == 8 for m in metrics)  # half the rows: left out, but the step trains
    assert not warnings_of(caplog)


def test_fail_on_unscored_steps_stops_with_one_line_naming_the_rewards(write_run, read_jsonl, capsys):
    path, run = write_run("never", **{"trainer.fail_on_unscored_steps": True})
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err  # after the model loading's progress bars: one line, no traceback
    assert "Traceback" not in err
    err = err.strip().splitlines()[-1]
    assert err.startswith("grouprl: reward error: step 1: no row was scored") and "rewards.py:never" in err
    assert "fail_on_unscored_steps" in err
    # the step it stopped at is in the log; no step after it ran
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1]


def test_a_run_with_one_scored_step_exits_0(write_run, read_jsonl, tmp_path):
    """Only a run in which no step at all had a scored row fails: a reward that applies from step 2 on
    is a run that trained."""
    (tmp_path / "rewards.py").write_text(REWARDS + """

_calls = []


def from_step_2(prompts, completions, **columns):
    _calls.append(1)
    return [None] * len(completions) if len(_calls) == 1 else [1.0] * len(completions)
""")
    path, run = write_run()
    values = yaml.safe_load(path.read_text())
    values["worker"]["reward"]["functions"] = [{"name": f"{tmp_path / 'rewards.py'}:from_step_2"}]
    path.write_text(yaml.safe_dump(values))
    assert main(["train", str(path)]) == 0
    assert [m["reward/unscored_steps"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 0, 0]
