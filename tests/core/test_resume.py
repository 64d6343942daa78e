"""Exact resume: a run killed at any moment and resumed reaches the uninterrupted run's weights bit for bit.

The run draws on every random source a step has: temperature sampling, shuffled
prompts, attention dropout (torch's RNG) and a reward that adds noise from Python's
and NumPy's RNGs. So the resumed run matches only if every RNG state is restored,
which `test_resume_needs_every_rng_state` checks by leaving each one out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import yaml

from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.grpo import GRPOTrainer
from grouprl.trainer.logging import MetricsLogger

NOISY_REWARD = '''
import random

import numpy as np


def noisy_length(prompts, completions, **kwargs):
    # Python's and NumPy's global RNGs, as a user's reward might use them
    return [(len(c) % 4) / 3 + 0.05 * random.random() + 0.05 * float(np.random.rand()) for c in completions]
'''


@pytest.fixture(scope="module")
def setup(say_task, tmp_path_factory):
    reward = tmp_path_factory.mktemp("resume") / "noisy.py"
    reward.write_text(NOISY_REWARD)
    return {"task": say_task(4, attention_dropout=0.3), "reward": reward}


def config(setup, out: Path, **trainer) -> dict:
    return setup["task"].config(out, [{"name": f"{setup['reward']}:noisy_length"}], **{
        # two mini-batches per step: the second optimizer step of a step is a place to die
        "worker.actor.global_batch_size": 2, "worker.actor.micro_batch_size_per_device_for_update": 3,
        "worker.rollout.n": 3, "worker.rollout.temperature": 1.0,
        "trainer.max_steps": 4, "trainer.save_freq": 2, "trainer.logger": ["jsonl", "tensorboard"],
        "trainer.seed": 5, "trainer.log_completions": True, **{f"trainer.{k}": v for k, v in trainer.items()}})


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}


def steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def tensorboard_steps(run: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    run = tmp_path_factory.mktemp("full") / "run"
    trainer = GRPOTrainer(config_from_dict(config(setup, run)))
    trainer.train()
    return {"run": run, "weights": weights(trainer),
            "metrics": [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]}


class Killed(BaseException):
    """Stands for SIGKILL: nothing in the trainer catches it."""


def kill_in_update_of_step_3(monkeypatch, trainer):
    """Dies inside step 3, after its first optimizer step has changed the weights."""
    step = trainer.optimizer.step
    calls = {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 6:  # 2 optimizer steps a step: the 6th is step 3's second
            raise Killed()
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer.optimizer, "step", dying)


def kill_after_logging_step_3(monkeypatch, trainer):
    """Dies once step 3's metrics are written (its rollouts are not)."""
    log = MetricsLogger.log

    def dying(self, step, metrics, **kwargs):
        log(self, step, metrics, **kwargs)
        if step == 3:
            raise Killed()

    monkeypatch.setattr(MetricsLogger, "log", dying)


def kill_while_saving_step_4(monkeypatch, trainer):
    """Dies in the middle of writing checkpoint 4 (model and optimizer written, the rest not)."""
    save = ckpt.save_state_dict

    def dying(state, directory, name):
        if name == "scheduler" and "global_step_4" in str(directory):
            raise Killed()
        return save(state, directory, name)

    monkeypatch.setattr(ckpt, "save_state_dict", dying)


def train_until_killed(setup, run: Path, monkeypatch, kill) -> None:
    killed = GRPOTrainer(config_from_dict(config(setup, run)))
    with monkeypatch.context() as patch:
        kill(patch, killed)
        with pytest.raises(Killed):
            killed.train()


@pytest.mark.parametrize("kill", [kill_in_update_of_step_3, kill_after_logging_step_3, kill_while_saving_step_4])
def test_killed_anywhere_then_resumed_matches_uninterrupted(setup, uninterrupted, tmp_path, monkeypatch, kill):
    run = tmp_path / "run"
    train_until_killed(setup, run, monkeypatch, kill)
    assert ckpt.latest_checkpoint(run / "checkpoints").name == "global_step_2"

    # TensorBoard reads event files in name order, and names start with the second they were
    # opened: a real resume comes seconds later; this one must not share the killed run's second
    time.sleep(1.1)
    resumed = GRPOTrainer(config_from_dict(config(setup, run, resume="auto")))
    resumed.train()
    assert resumed.state.global_step == 4
    want, got = uninterrupted["weights"], weights(resumed)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{key} differs from the uninterrupted run"
    # every log holds each step once, with the uninterrupted run's values
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["reward/mean"] for m in metrics] == [m["reward/mean"] for m in uninterrupted["metrics"]]
    rows_per_step = 4 * 3
    for name in ("rollouts.jsonl", "completions.jsonl"):
        assert steps_in(run / name) == [s for s in (1, 2, 3, 4) for _ in range(rows_per_step)], name
    assert tensorboard_steps(run, "reward/mean") == [1, 2, 3, 4]


@pytest.mark.parametrize("source", ["python", "numpy", "torch"])
def test_resume_needs_every_rng_state(setup, uninterrupted, tmp_path, monkeypatch, source):
    """Resuming without one RNG state gives other weights: the test above would catch a lost RNG state."""
    run = tmp_path / "run"
    train_until_killed(setup, run, monkeypatch, kill_in_update_of_step_3)
    restore = ckpt.set_rng_state

    def forgetful(state):
        current = ckpt.rng_state()
        restore({**state, source: current[source]})  # everything but `source` comes back

    monkeypatch.setattr(ckpt, "set_rng_state", forgetful)
    resumed = GRPOTrainer(config_from_dict(config(setup, run, resume="auto")))
    resumed.train()
    want, got = uninterrupted["weights"], weights(resumed)
    assert any(not torch.equal(got[k], want[k]) for k in want), f"the {source} RNG state made no difference"


def test_learning_rate_schedule_ends_with_the_run(setup, tmp_path):
    """Cosine decay reaches its floor at the last step, with dynamic sampling skipping and shrinking steps."""
    cfg = config(setup, tmp_path / "run", max_steps=5, save_freq=-1, logger=["jsonl"], log_completions=False)
    cfg["worker"]["actor"]["optim"].update(lr=1e-3, lr_scheduler_type="cosine", min_lr_ratio=0.1)
    # exact-match accuracy is mostly 0 for this model: many groups have no spread and are dropped
    cfg["worker"]["reward"]["functions"] = [{"name": "accuracy"}]
    cfg["algorithm"] = {"online_filtering": True, "max_filter_rounds": 0}
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    lrs = [json.loads(x)["actor/lr"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lrs) == 5
    assert lrs[0] == pytest.approx(1e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert trainer.scheduler.last_epoch == 5


# ---------------------------------------------------------------------------- resuming under another config


def test_only_what_trains_counts_as_a_changed_config():
    from grouprl.trainer.resume_config import training_changes

    saved = {"algorithm": {"kl_coef": 0.0}, "worker": {"rollout": {"n": 4, "val_n": 1, "micro_batch_size": 2},
                                                       "actor": {"micro_batch_size_per_device_for_update": 4}},
             "trainer": {"max_steps": 4, "total_epochs": 1, "logger": ["jsonl"], "save_freq": 2, "val_freq": 1,
                         "resume": None, "output_dir": "a", "seed": 1}, "sft": {"lr": 1e-5}, "data": {"old": 1}}
    current = {"algorithm": {"kl_coef": 0.1}, "worker": {"rollout": {"n": 8, "val_n": 4, "micro_batch_size": 8},
                                                         "actor": {"micro_batch_size_per_device_for_update": 1}},
               "trainer": {"max_steps": 9, "total_epochs": 3, "logger": ["console"], "save_freq": 5, "val_freq": 3,
                           "resume": "auto", "output_dir": "b", "seed": 2, "resume_if_config_changed": True},
               "sft": {"lr": 1e-4}, "data": {"new": 1}}  # a key only one version has is not compared
    assert training_changes(saved, current) == [("algorithm.kl_coef", 0.0, 0.1), ("trainer.seed", 1, 2),
                                                ("worker.rollout.n", 4, 8)]


def test_a_checkpoint_is_not_resumed_under_a_config_that_trains_something_else(setup, uninterrupted, tmp_path):
    checkpoint = uninterrupted["run"] / "checkpoints" / "global_step_2"
    run = tmp_path / "other"
    changed = config(setup, run, resume=str(checkpoint), max_steps=3)
    changed["algorithm"] = {"kl_coef": 0.5}
    changed["worker"]["rollout"]["top_p"] = 0.9
    trainer = GRPOTrainer(config_from_dict(changed))
    with pytest.raises(ConfigError) as exc:
        trainer.train()
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint {checkpoint} was trained with another config (")
    assert "algorithm.kl_coef: 0.0 -> 0.5; worker.rollout.top_p: 1.0 -> 0.9)" in msg
    assert "trainer.resume_if_config_changed=true" in msg
    # refused before anything was written (the output directories were only probed for writing)
    assert not [p for p in run.rglob("*") if p.is_file()]
    assert trainer.state.global_step == 0


def test_logging_paths_length_and_cadence_may_change_on_resume(setup, uninterrupted, tmp_path, capsys):
    checkpoint = uninterrupted["run"] / "checkpoints" / "global_step_2"
    cfg = config(setup, tmp_path / "other", resume=str(checkpoint), max_steps=3, save_freq=-1, logger=["jsonl"],
                 log_completions=False, experiment_name="another", total_epochs=5, val_freq=7)
    cfg["worker"]["actor"]["micro_batch_size_per_device_for_update"] = 1
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    assert trainer.state.global_step == 3
    assert "changed config" not in capsys.readouterr().out


def test_resume_if_config_changed_resumes_and_names_the_changes(setup, uninterrupted, tmp_path, capsys):
    checkpoint = uninterrupted["run"] / "checkpoints" / "global_step_2"
    cfg = config(setup, tmp_path / "other", resume=str(checkpoint), max_steps=3, resume_if_config_changed=True)
    cfg["worker"]["actor"]["optim"]["lr"] = 1e-3
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    assert trainer.state.global_step == 3
    out = capsys.readouterr().out
    assert (f"grouprl: resuming {checkpoint} under a changed config (trainer.resume_if_config_changed): "
            "worker.actor.optim.lr: 0.01 -> 0.001") in out


def test_a_run_resumed_at_its_last_step_says_nothing_is_left(setup, uninterrupted, tmp_path, capsys):
    checkpoint = uninterrupted["run"] / "checkpoints" / "global_step_4"
    trainer = GRPOTrainer(config_from_dict(config(setup, tmp_path / "other", resume=str(checkpoint))))
    trainer.train()
    assert trainer.state.global_step == 4
    assert (f"grouprl: nothing left to train: checkpoint {checkpoint} is at step 4 and the run ends at step 4 "
            "(trainer.max_steps); raise it to train on") in capsys.readouterr().out


def test_two_easyr1_experiments_sharing_a_checkpoint_path_do_not_resume_each_other(setup, uninterrupted, tmp_path,
                                                                                    capsys):
    """EasyR1's find_last_checkpoint (trainer.resume: auto) with another experiment's save_checkpoint_path:
    `grouprl train` refuses in one line naming the differing key, exit code 2."""
    from grouprl.cli import main

    cfg = config(setup, tmp_path / "second", seed=6, save_checkpoint_path=str(uninterrupted["run"] / "checkpoints"),
                 find_last_checkpoint=True)
    path = tmp_path / "second.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' "Loading weights" bar
    assert err.startswith("grouprl: config error: checkpoint ")
    assert "global_step_4 was trained with another config (trainer.seed: 5 -> 6)" in err
    assert not [p for p in (tmp_path / "second").rglob("*") if p.is_file()]
