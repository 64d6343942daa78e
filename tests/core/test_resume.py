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

from grouprl.config import config_from_dict
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
