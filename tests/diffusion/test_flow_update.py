"""The flow trainer's update: zero-advantage rows left out of the forward pass at no change to the update,
the deterministic last step, the peers' clip fraction beside grouprl's, and the first ratio of an update
exactly 1 in bf16 as in fp32."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from grouprl.config import ConfigError  # noqa: E402
from grouprl.domains.diffusion.config import FlowRolloutConfig  # noqa: E402
from grouprl.domains.diffusion.objectives import clipped_policy_loss, ratio_outside_clip  # noqa: E402
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer  # noqa: E402

# prompts in file order: each step's first prompt has an even tag, and its images one reward
HALF_FLAT = """
from grouprl.domains.diffusion.rewards import image_brightness_reward


def half_flat(images, prompts, tag, **metadata):
    bright = image_brightness_reward(images, prompts)
    return [0.5 if t % 2 == 0 else b for t, b in zip(tag, bright)]
"""
FLAT = "def flat(images, prompts, **metadata):\n    return [0.5] * len(images)\n"


def reward_file(tmp_path, source: str, name: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return f"{path}:{name}"


def no_kl(tmp_path, reward: str, **extra) -> dict:
    return {"algorithm.kl_coef": 0.0, "data.shuffle": False, "trainer.val_freq": -1, "trainer.save_freq": -1,
            "worker.reward.functions": [{"name": reward}], **extra}


# first_update_grads wraps optimizer.step, which the LR scheduler notices
pytestmark = pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")


def first_update_grads(trainer) -> tuple[list, list]:
    """Record the gradients of each optimizer step and the rows each update scoring call saw."""
    grads, rows = [], []
    trainable = [p for p in trainer.policy.parameters() if p.requires_grad]
    real_step, real_score = trainer.optimizer.step, trainer._score

    def step(*args, **kwargs):
        grads.append([p.grad.clone() for p in trainable])
        return real_step(*args, **kwargs)

    def score(model, part):
        rows.append(len(part))
        return real_score(model, part)

    trainer.optimizer.step, trainer._score = step, score
    return grads, rows


@pytest.mark.parametrize(("algorithm", "steps"), [("flow_grpo_fast", 2), ("grpo_guard", 3)])
def test_zero_advantage_rows_are_not_run_and_the_update_is_unchanged(flow_config, tmp_path, read_jsonl, algorithm,
                                                                      steps):
    reward = reward_file(tmp_path, HALF_FLAT, "half_flat")
    runs = {}
    for skip in (True, False):
        trainer = FlowGRPOTrainer(flow_config(tmp_path / str(skip), **no_kl(tmp_path, reward, **{
            "algorithm.name": algorithm, "algorithm.timestep_fraction": 0.75})))
        trainer.skip_zero_advantage = skip
        runs[skip] = (trainer, *first_update_grads(trainer))
        trainer.train()
    (_, grads_skip, rows_skip), (_, grads_all, rows_all) = runs[True], runs[False]
    # 2 training steps of 8 images x `steps` trained steps, 2 mini-batches each; half the images have A = 0
    rows = 8 * steps
    assert sum(rows_all) == 2 * rows
    micro_batches = 2 * 2 * -(-rows // 2 // 3)  # steps x mini-batches x micro-batches of 3 rows
    assert sum(rows_skip) <= 2 * rows // 2 + micro_batches  # the trained rows, at most one more per micro-batch
    assert sum(rows_skip) < sum(rows_all)
    assert len(grads_skip) == len(grads_all) == 4
    for a, b in zip(grads_skip, grads_all):  # every optimizer step: the same gradient (normaliser unchanged)
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-8)
    for skip in (True, False):
        metrics = [m for m in read_jsonl(tmp_path / str(skip) / "metrics.jsonl") if "reward/mean" in m]
        assert [m["actor/zero_advantage_rows"] for m in metrics] == [rows / 2] * 2
        assert [m["actor/skipped_rows"] for m in metrics] == ([rows / 2] * 2 if skip else [0.0, 0.0])
    same = [m["actor/pg_loss"] for m in read_jsonl(tmp_path / "True" / "metrics.jsonl") if "reward/mean" in m]
    other = [m["actor/pg_loss"] for m in read_jsonl(tmp_path / "False" / "metrics.jsonl") if "reward/mean" in m]
    # a sum of +-A r terms of order 1 that nearly cancel: equal to float32 rounding of the rows' log-probs
    assert same == pytest.approx(other, rel=1e-5, abs=1e-7)


def test_a_batch_without_advantage_runs_one_row_per_micro_batch_with_zero_gradient(flow_config, tmp_path):
    reward = reward_file(tmp_path, FLAT, "flat")
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **no_kl(tmp_path, reward, **{"trainer.max_steps": 1})))
    grads, rows = first_update_grads(trainer)
    last = trainer.train()
    assert rows == [1] * 6  # 16 rows in 2 mini-batches of 3 micro-batches: one row each, loss 0
    assert all(float(g.abs().max()) == 0 for step in grads for g in step)
    assert last["actor/skipped_rows"] == 16 and last["actor/pg_loss"] == 0


def test_with_a_kl_term_zero_advantage_rows_are_trained(flow_config, tmp_path):
    reward = reward_file(tmp_path, HALF_FLAT, "half_flat")
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **no_kl(tmp_path, reward, **{
        "algorithm.kl_coef": 0.04, "trainer.max_steps": 1})))
    _, rows = first_update_grads(trainer)
    last = trainer.train()
    # the reference means (16 rows) and the update (16 rows): the KL term moves A = 0 rows too
    assert sum(rows) == 2 * 16
    assert last["actor/zero_advantage_rows"] == 8 and last["actor/skipped_rows"] == 0


def test_the_last_step_is_deterministic_by_default():
    assert FlowRolloutConfig().deterministic_last_step is True


@pytest.mark.parametrize("deterministic", [True, False])
def test_the_last_step_is_an_ode_step_unless_asked(flow_config, tmp_path, deterministic):
    key = "worker.rollout.deterministic_last_step"
    grpo = FlowGRPOTrainer(flow_config(tmp_path / "grpo", **{key: deterministic, "algorithm.name": "flow_grpo",
                                                             "algorithm.timestep_fraction": 1.0}))
    sde, store = grpo._trained_steps(torch.Generator().manual_seed(0))
    assert (sde, store) == (([0, 1, 2], [0, 1, 2]) if deterministic else ([0, 1, 2, 3], [0, 1, 2, 3]))
    fast = FlowGRPOTrainer(flow_config(tmp_path / "fast", **{key: deterministic, "worker.rollout.sde_window_size": 1,
                                                             "worker.rollout.sde_window_range": [2, 4]}))
    windows = {tuple(fast._trained_steps(torch.Generator().manual_seed(seed))[1]) for seed in range(40)}
    assert windows == ({(2,)} if deterministic else {(2,), (3,)})


def test_a_window_that_needs_the_last_step_names_the_keys(flow_config, tmp_path):
    with pytest.raises(ConfigError, match="sde_window_size.*deterministic_last_step"):
        flow_config(tmp_path, **{"worker.rollout.sde_window_size": 4})
    flow_config(tmp_path, **{"worker.rollout.sde_window_size": 4, "worker.rollout.deterministic_last_step": False})
    with pytest.raises(ConfigError, match="timestep_fraction.*deterministic_last_step"):
        flow_config(tmp_path, **{"algorithm.name": "flow_grpo", "worker.rollout.num_steps": 1,
                                 "worker.rollout.val_num_steps": 1, "worker.rollout.sde_window_range": [0, 1],
                                 "worker.rollout.sde_window_size": 1})


def test_clipfrac_is_the_peers_and_clipped_grad_frac_grouprls():
    log_ratio = torch.tensor([0.05, 0.05, -0.05, -0.05, 0.0])
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0])
    _, ratio, clipped = clipped_policy_loss(log_ratio, torch.zeros(5), advantages, 0.01)
    assert ratio_outside_clip(ratio, 0.01).tolist() == [True, True, True, True, False]  # |r - 1| > eps
    assert clipped.tolist() == [True, False, False, True, False]  # the gradient is zeroed


def test_the_trainer_logs_both_clip_fractions(flow_config, tmp_path, read_jsonl):
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **{"algorithm.clip_range": 1e-4, "trainer.val_freq": -1,
                                                              "trainer.save_freq": -1}))
    expected = {"outside": [], "clipped": []}
    real = trainer._loss_fn

    def noting(part, log_prob, aux, norms, metrics):
        ratio = torch.exp(log_prob.detach()[:, 0] - part.old_log_prob)
        expected["outside"] += ((ratio - 1).abs() > 1e-4).tolist()
        expected["clipped"] += (((part.advantages > 0) & (ratio > 1 + 1e-4)) |
                                ((part.advantages < 0) & (ratio < 1 - 1e-4))).tolist()
        return real(part, log_prob, aux, norms, metrics)

    trainer._loss_fn = noting
    trainer.train()
    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m]
    outside = sum(m["actor/clipfrac"] for m in metrics) / len(metrics)
    clipped = sum(m["actor/clipped_grad_frac"] for m in metrics) / len(metrics)
    assert outside == pytest.approx(sum(expected["outside"]) / len(expected["outside"]))
    assert clipped == pytest.approx(sum(expected["clipped"]) / len(expected["clipped"]))
    assert outside > clipped  # the second update's ratios move; the peers' count includes the harmless side


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_first_ratio_of_each_update_is_one(flow_config, tmp_path, dtype):
    """The rollout and the update's re-scoring call the transformer alike (input dtype, autocast): the first
    micro-batch of every update, at the weights that sampled, has log-ratio 0 (bf16 gave 1e-5 .. 2e-4)."""
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **{
        "worker.actor.model.dtype": dtype, "algorithm.kl_coef": 0.0, "trainer.max_steps": 3,
        "trainer.val_freq": -1, "trainer.save_freq": -1}))
    first = {}
    real = trainer._loss_fn

    def noting(part, log_prob, aux, norms, metrics):
        first.setdefault(trainer.state.global_step, float((log_prob.detach()[:, 0] - part.old_log_prob).abs().max()))
        return real(part, log_prob, aux, norms, metrics)

    trainer._loss_fn = noting
    trainer.train()
    assert len(first) == 3
    # steps 2 and 3 sample with trained (non-zero) LoRA weights, where bf16 rollouts without autocast differed
    assert all(v <= 1e-6 for v in first.values()), first
