"""The flow trainer end to end on a tiny pixel-space SD3 transformer: Flow-GRPO, Flow-GRPO-Fast,
GRPO-Guard, checkpoints and exact resume, async reward, validation grids, the command line."""

from __future__ import annotations

import json
import threading

import pytest
from PIL import Image
import torch
import yaml

pytest.importorskip("diffusers")

from grouprl.cli import main  # noqa: E402
from grouprl.config import ConfigError  # noqa: E402
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer  # noqa: E402


def lora_state(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if "lora_" in k}


def test_fast_trains_only_the_window_and_moves_the_adapters(flow_config, tmp_path, read_jsonl):
    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **{"trainer.logger": ["jsonl", "tensorboard"]}))
    before = lora_state(trainer)
    seen = []
    real = trainer._log_prob_fn

    def spy(model, part):
        seen.append(part.timestep.clone())
        return real(model, part)

    trainer._log_prob_fn = spy
    trainer.train()
    after = lora_state(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    rows = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert len(rows) == 2 * 2 * 4  # steps x prompts x n
    for step in (1, 2):
        windows = {tuple(r["steps"]) for r in rows if r["step"] == step}
        assert len(windows) == 1
        (window,) = windows
        assert len(window) == 2 and window[1] == window[0] + 1 and 0 <= window[0] <= 2
    # every row the update scored was at a window step: its timestep is one of the window's
    trained = torch.cat(seen).unique()
    allowed = torch.cat([trainer.sched.timesteps[list(w)] for w in {tuple(r["steps"]) for r in rows}]).unique()
    assert set(trained.tolist()) <= set(allowed.tolist())
    # rows = images x window steps, every epoch: 8 images x 2 steps per training step
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    train = [m for m in metrics if "reward/mean" in m and "val/reward/mean" not in m]
    assert [m["step"] for m in train] == [1, 2]
    for m in train:
        assert m["rollout/trained_steps"] == 2 and m["actor/grad_norm"] > 0
        assert "actor/kl_loss" in m and "actor/clipfrac" in m and "actor/ratio/mean" in m
    assert (tmp_path / "run" / "val_images" / "step_000002.png").read_bytes()[:4] == b"\x89PNG"
    # the validation grid goes to TensorBoard too (the loggers' samples), as the PNG shows it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    (logged,) = events.Images("samples/val/image_0")
    with Image.open(tmp_path / "run" / "val_images" / "step_000002.png") as png:
        assert (logged.step, logged.width, logged.height) == (2, png.width, png.height)


@pytest.mark.parametrize("algorithm", ["flow_grpo", "grpo_guard"])
def test_flow_grpo_and_guard_train(flow_config, tmp_path, read_jsonl, algorithm):
    config = flow_config(tmp_path / "run", **{"algorithm.name": algorithm,
                                                                   "algorithm.timestep_fraction": 0.75,
                                                                   "trainer.max_steps": 1})
    trainer = FlowGRPOTrainer(config)
    before = lora_state(trainer)
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())
    rows = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert all(r["steps"] == [0, 1, 2] for r in rows)  # the first 75% of 4 steps, every one an SDE step


def test_resume_continues_exactly(flow_config, tmp_path, read_jsonl):
    full = FlowGRPOTrainer(flow_config(tmp_path / "full", **{"trainer.max_steps": 3}))
    full.train()
    first = FlowGRPOTrainer(flow_config(tmp_path / "cut", **{"trainer.max_steps": 1}))
    first.train()
    resumed = FlowGRPOTrainer(flow_config(tmp_path / "cut",
                                          **{"trainer.max_steps": 3, "trainer.resume": "auto"}))
    resumed.train()
    a, b = lora_state(full), lora_state(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    train = lambda out: [m for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m]  # noqa: E731
    assert [m["step"] for m in train(tmp_path / "cut")] == [1, 2, 3]
    assert [m["reward/mean"] for m in train(tmp_path / "cut")] == [m["reward/mean"] for m in train(tmp_path / "full")]


def test_async_reward_gives_the_sync_result(flow_config, tmp_path, read_jsonl):
    runs = {}
    for mode in ("sync", "async_reward"):
        trainer = FlowGRPOTrainer(flow_config(tmp_path / mode,
                                              **{"trainer.async_mode": mode, "trainer.max_steps": 1}))
        trainer.train()
        runs[mode] = lora_state(trainer)
        assert "timing/reward_wait_s" in read_jsonl(tmp_path / mode / "metrics.jsonl")[0]
    assert all(torch.equal(runs["sync"][k], runs["async_reward"][k]) for k in runs["sync"])


def test_one_step_off_samples_the_next_batch_during_the_update(flow_config, tmp_path, read_jsonl, watch_updates,
                                                                 monkeypatch):
    import grouprl.domains.diffusion.trainer as flow_trainer

    trainer = FlowGRPOTrainer(flow_config(tmp_path / "run", **{
        "trainer.async_mode": "one_step_off", "trainer.max_steps": 3, "worker.actor.num_minibatches": 1,
        "algorithm.kl_coef": 0.0}))
    assert trainer.sampler is not trainer.policy
    updates = watch_updates(trainer)  # one optimizer step per training step here
    background, first_ratio = [], {}

    real_sample = flow_trainer.sample

    def watched_sample(model, *args, **kwargs):
        if threading.current_thread().name.startswith("grouprl-rollout"):
            assert model is trainer.sampler
            background.append(1)
            if len(background) % 3 == 1:  # the first of the 3 micro-batches of background rollout j
                j = (len(background) + 2) // 3
                # sampling for step j + 1 goes on only once step j's update is under way
                assert updates.wait_for(j, 60), f"the rollout for step {j + 1} finished before step {j}'s update began"
        return real_sample(model, *args, **kwargs)

    real_loss = trainer._loss_fn

    def noting_loss(part, log_prob, aux, norms, metrics):
        # the first micro-batch of each update runs at the weights the old log-probs came from
        first_ratio.setdefault(updates.count + 1, float((log_prob.detach()[:, 0] - part.old_log_prob).abs().max()))
        return real_loss(part, log_prob, aux, norms, metrics)

    monkeypatch.setattr(flow_trainer, "sample", watched_sample)
    trainer._loss_fn = noting_loss
    before = lora_state(trainer)
    trainer.train()
    assert len(background) == 6  # steps 2 and 3 sampled in the worker, 3 micro-batches each
    train = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m]
    assert [m["async/staleness_steps"] for m in train] == [0.0, 1.0, 1.0]
    # stale rows were sampled one update earlier, and their old log-probs were recomputed
    assert all(m["async/behaviour_log_ratio_abs"] > 0 for m in train[1:])
    assert all(first_ratio[step] < 1e-5 for step in (1, 2, 3)), first_ratio
    assert any(not torch.equal(before[k], v) for k, v in lora_state(trainer).items())


def test_one_step_off_resumes_at_the_right_prompts(flow_config, tmp_path, read_jsonl, interrupt_at_step):
    """The next batch is drawn before a checkpoint is written: the checkpoint still records the trained position."""
    extra = {"trainer.async_mode": "one_step_off", "trainer.max_steps": 3, "data.rollout_batch_size": 1}
    FlowGRPOTrainer(flow_config(tmp_path / "full", **extra)).train()
    killed = FlowGRPOTrainer(flow_config(tmp_path / "cut", **extra, **{"trainer.save_freq": 2}))
    interrupt_at_step(killed, 3)
    FlowGRPOTrainer(flow_config(tmp_path / "cut", **extra,
                                **{"trainer.save_freq": 2, "trainer.resume": "auto"})).train()

    def prompts_of(run, step):
        return sorted({r["prompt"] for r in read_jsonl(run / "rollouts.jsonl") if r["step"] == step})

    assert prompts_of(tmp_path / "cut", 3) == prompts_of(tmp_path / "full", 3)


def test_train_command_reads_a_flow_config(flow_config, tmp_path):
    config = flow_config(tmp_path / "cli", **{"trainer.max_steps": 1})
    from grouprl.config import redacted

    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(redacted(config)))
    assert main(["train", str(path), "trainer.val_freq=-1"]) == 0
    saved = yaml.safe_load((tmp_path / "cli" / "config.yaml").read_text())
    assert saved["kind"] == "flow" and saved["algorithm"]["name"] == "flow_grpo_fast"
    assert (tmp_path / "cli" / "checkpoints" / "global_step_1" / "model" / "adapter_model.safetensors").exists()
    metrics = [json.loads(line) for line in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[0]["reward/unscored_steps"] == 0  # the language trainer's schema: every image was scored


def test_an_image_no_reward_applies_to_stops_the_run_in_one_line(flow_config, tmp_path, capsys):
    """The flow trainer needs a score for every image (its advantages are per image), so an image no
    reward applies to stops the run at once, with or without ``trainer.fail_on_unscored_steps``:
    one line naming the rewards, not a traceback."""
    (tmp_path / "never.py").write_text("def never(images, prompts, **metadata):\n    return [None] * len(images)\n")
    config = flow_config(tmp_path / "never", **{"trainer.max_steps": 1, "trainer.val_freq": -1,
                                                "worker.reward.functions": [{"name": f"{tmp_path}/never.py:never"}]})
    from grouprl.config import redacted

    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(redacted(config)))
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("grouprl: reward error: row 0: every image reward returned None") and "never.py:never" in last


def test_flow_config_errors_name_the_key(flow_config, tmp_path):
    from grouprl.config import ConfigError

    with pytest.raises(ConfigError, match="worker.rollout.sde_window_size"):
        flow_config(tmp_path, **{"worker.rollout.sde_window_size": 5})
    with pytest.raises(ConfigError, match="unknown config key 'worker.rollout.noise'.*noise_level"):
        flow_config(tmp_path, **{"worker.rollout.noise": 0.5})
    with pytest.raises(ConfigError, match="worker.actor.model.lora.rank"):
        flow_config(tmp_path, **{"worker.actor.model.lora": {"rank": 0}})


def test_max_wall_seconds_stops_after_the_step_that_ran_past_it_with_a_checkpoint(flow_config, tmp_path, read_jsonl,
                                                                                  capsys):
    """trainer.max_wall_seconds (the run loop's, shared with the language trainer): a limit every step
    exceeds ends the run after its first step, checkpointed; a generous one changes nothing."""
    out = tmp_path / "run"
    FlowGRPOTrainer(flow_config(out, **{"trainer.max_steps": 3, "trainer.max_wall_seconds": 1e-6,
                                        "trainer.save_freq": -1, "trainer.val_freq": -1})).train()
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl") if "reward/mean" in m] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["global_step_1"]
    assert "trainer.max_wall_seconds (1e-06 s) reached after step 1" in capsys.readouterr().out
    FlowGRPOTrainer(flow_config(tmp_path / "long", **{"trainer.max_steps": 2, "trainer.max_wall_seconds": 3600,
                                                      "trainer.val_freq": -1})).train()
    assert [m["step"] for m in read_jsonl(tmp_path / "long" / "metrics.jsonl") if "reward/mean" in m] == [1, 2]
    with pytest.raises(ConfigError, match="trainer.max_wall_seconds"):
        FlowGRPOTrainer(flow_config(tmp_path / "bad", **{"trainer.max_wall_seconds": 0}))


def test_zero_std_fraction_counts_images_in_groups_without_spread():
    from grouprl.domains.diffusion.trainer import zero_std_fraction

    # groups of 3: equal, spread, equal
    assert zero_std_fraction([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.2, 0.2, 0.2], 3) == pytest.approx(2 / 3)
    assert zero_std_fraction([], 3) == 0.0


def test_a_flow_run_logs_reward_spread_and_its_health(flow_config, tmp_path, read_jsonl):
    """The health alarms judge flow runs in the shared run loop: frac_reward_zero_std and health/<alarm>."""
    from grouprl.trainer.health import ALARMS

    from grouprl.domains.diffusion.trainer import zero_std_fraction

    config = flow_config(tmp_path / "run", **{"trainer.max_steps": 2, "trainer.health.recent": 1,
                                              "trainer.health.max_zero_std": 0.0})
    FlowGRPOTrainer(config).train()
    rows = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2] and all(f"health/{a}" in m for m in rows for a in ALARMS)
    images = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    for m in rows:  # the images of a prompt are consecutive rows
        scores = [r["score"] for r in images if r["step"] == m["step"]]
        assert m["frac_reward_zero_std"] == pytest.approx(zero_std_fraction(scores, config.worker.rollout.n))
    # max_zero_std 0: any group without spread fires it
    alarms = [a["alarm"] for a in read_jsonl(tmp_path / "run" / "alarms.jsonl")] \
        if (tmp_path / "run" / "alarms.jsonl").exists() else []
    assert ("no_reward_spread" in alarms) == any(m["frac_reward_zero_std"] > 0 for m in rows)


def test_a_pairwise_judge_needs_whole_groups_in_each_reward_call(flow_config, tmp_path):
    from grouprl.config import ConfigError

    pairwise = [{"name": "vlm_judge", "kwargs": {"mode": "unified_reward_pairwise", "base_url": "http://judge/v1"}}]
    with pytest.raises(ConfigError, match=r"worker.reward.functions\[0\].*micro_batch_size' \(3\) is not a multiple "
                                          r"of 'worker.rollout.n' \(4\)"):
        flow_config(tmp_path, **{"worker.reward.functions": pairwise, "worker.rollout.micro_batch_size": 3,
                                 "worker.rollout.n": 4})
    config = flow_config(tmp_path, **{"worker.reward.functions": pairwise, "worker.rollout.micro_batch_size": 8,
                                      "worker.rollout.n": 4})
    assert config.worker.rollout.micro_batch_size == 8


def test_video_frames_on_an_image_model_are_one_line_with_exit_2(flow_config, tmp_path, capsys):
    from grouprl.config import redacted

    config = flow_config(tmp_path / "run", **{"worker.rollout.num_frames": 5, "trainer.max_steps": 1})
    path = tmp_path / "flow.yaml"
    path.write_text(yaml.safe_dump(redacted(config)))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'worker.rollout.num_frames' is 5" in err[0] and "an image model (sd3)" in err[0]


def test_each_flow_trainer_refuses_another_algorithm_and_flow_trainer_picks(flow_config, tmp_path):
    from grouprl.config import ConfigError
    from grouprl.domains.diffusion.trainer import DiffusionNFTTrainer, flow_trainer

    config = flow_config(tmp_path / "run")  # flow_grpo_fast
    with pytest.raises(ConfigError, match="'flow_grpo_fast', which DiffusionNFTTrainer does not train"):
        DiffusionNFTTrainer(config)
    assert type(flow_trainer(config)) is FlowGRPOTrainer
