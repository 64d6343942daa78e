"""Asynchronous modes: rewards scored while the next micro-batch generates, and one-step-off training.

Overlap is shown by order, never by timing: a reward (or an optimizer step) waits for
an event that only the overlapping work sets, with a timeout that fails the test in
a loop that does not overlap.
"""

from __future__ import annotations

import threading

import pytest
import torch

from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer.grpo import GRPOTrainer

WAIT = 60  # seconds: only reached when the overlap is missing (the test then fails)

REWARD = '''
import zlib

def varied(prompts, completions, **kwargs):
    return [(zlib.crc32(c.encode()) % 7) / 6 for c in completions]
'''


@pytest.fixture(scope="module")
def setup(say_task, tmp_path_factory):
    reward = tmp_path_factory.mktemp("async") / "reward.py"
    reward.write_text(REWARD)
    return {"task": say_task(4), "reward": reward}


def config(setup, out, mode: str, **extra) -> dict:
    return setup["task"].config(out, [{"name": f"{setup['reward']}:varied"}], **{
        "worker.actor.global_batch_size": 4, "worker.actor.micro_batch_size_per_device_for_update": 8,
        "worker.rollout.n": 2, "worker.rollout.micro_batch_size": 4,  # two generation micro-batches per step
        "trainer.max_steps": 3, "trainer.async_mode": mode, "trainer.save_freq": -1, **extra})


def test_async_reward_trains_exactly_like_sync(setup, tmp_path, read_jsonl):
    sync = GRPOTrainer(config_from_dict(config(setup, tmp_path / "sync", "sync")))
    sync.train()
    overlapped = GRPOTrainer(config_from_dict(config(setup, tmp_path / "async", "async_reward")))
    overlapped.train()
    keys = ("step", "id", "response", "score", "advantage")
    assert [[r[k] for k in keys] for r in read_jsonl(tmp_path / "async" / "rollouts.jsonl")] == \
        [[r[k] for k in keys] for r in read_jsonl(tmp_path / "sync" / "rollouts.jsonl")]
    for (name, a), b in zip(sync.policy.named_parameters(), overlapped.policy.parameters()):
        assert torch.equal(a, b), name


def test_async_reward_scores_while_the_next_micro_batch_generates(setup, tmp_path):
    """The reward of micro-batch 1 waits until micro-batch 2 has begun generating."""
    trainer = GRPOTrainer(config_from_dict(config(setup, tmp_path / "run", "async_reward",
                                                  **{"trainer.max_steps": 1})))
    second_began = threading.Event()
    generate = trainer.engine.generate
    calls = []

    def watched_generate(samples, params, **kwargs):
        calls.append(threading.current_thread().name)
        if len(calls) == 2:
            second_began.set()
        return generate(samples, params, **kwargs)

    reward = trainer.rewards.components[0]
    threads = []

    def blocking_reward(prompts, completions, **columns):
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            assert second_began.wait(WAIT), "micro-batch 1 was scored before micro-batch 2 began generating"
        return reward.fn(prompts, completions, **columns)

    trainer.engine.generate = watched_generate
    trainer.rewards.components[0] = type(reward)(reward.key, blocking_reward, reward.weight, reward.spec)
    trainer.train()
    assert len(calls) == 2 and all(name.startswith("grouprl-rewards") for name in threads)


def test_one_step_off_generates_the_next_batch_during_the_update(setup, tmp_path, read_jsonl, watch_updates):
    trainer = GRPOTrainer(config_from_dict(config(setup, tmp_path / "run", "one_step_off")))
    assert trainer.engine.holds_weights and trainer.correct_rollout  # a copy to sample from, and IS weights
    updates = watch_updates(trainer)  # one optimizer step per training step here
    background_calls = []
    generate = trainer.engine.generate

    def watched_generate(samples, params, **kwargs):
        if threading.current_thread().name.startswith("grouprl-rollout"):
            background_calls.append(1)
            call = len(background_calls)
            if call % 2 == 1:  # the first of the two micro-batches of background rollout j = (call + 1) // 2
                j = (call + 1) // 2
                # generating for step j + 1 goes on only once step j's update is under way
                assert updates.wait_for(j, WAIT), \
                    f"the rollout for step {j + 1} finished before step {j}'s update began"
        return generate(samples, params, **kwargs)

    trainer.engine.generate = watched_generate
    before = {k: v.detach().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["async/staleness_steps"] for m in metrics] == [0.0, 1.0, 1.0]
    for m in metrics:
        assert m["mismatch/weight_mean"] is not None and m["actor/skipped_step"] == 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.policy.named_parameters())
    # the engine's copy follows the trained weights once the pipeline drains
    copy = dict(trainer.engine.model.named_parameters())
    assert all(torch.equal(copy[k], v) for k, v in trainer.policy.named_parameters())


def test_one_step_off_resumes_at_the_right_prompts(setup, tmp_path, read_jsonl, interrupt_at_step):
    """The next batch is drawn before a checkpoint is written: the checkpoint still records the trained position."""
    full = GRPOTrainer(config_from_dict(config(setup, tmp_path / "full", "one_step_off")))
    full.train()
    # saved at step 2 while step 3's batch was being drawn and generated; killed at step 3
    killed = GRPOTrainer(config_from_dict(config(setup, tmp_path / "cut", "one_step_off",
                                                 **{"trainer.save_freq": 2})))
    interrupt_at_step(killed, 3)
    resumed = config(setup, tmp_path / "cut", "one_step_off", **{"trainer.resume": "auto", "trainer.save_freq": 2})
    GRPOTrainer(config_from_dict(resumed)).train()

    def prompts_of(run, step):
        return sorted({r["id"] for r in read_jsonl(run / "rollouts.jsonl") if r["step"] == step})

    assert prompts_of(tmp_path / "cut", 3) == prompts_of(tmp_path / "full", 3)


@pytest.mark.parametrize("overrides, message", [
    ({"trainer.async_mode": "async_reward", "worker.rollout.micro_batch_size": None}, "set 'worker.rollout.micro_batch_size'"),
    ({"trainer.async_mode": "one_step_off", "algorithm.online_filtering": True}, "online_filtering"),
    ({"trainer.async_mode": "async_reward", "algorithm.force_gt_num": 1}, "EditTransform chooses rows across"),
])
def test_async_modes_refuse_what_they_cannot_do(setup, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        GRPOTrainer(config_from_dict(config(setup, tmp_path / "run", "sync", **overrides)))
