"""End-to-end: tiny text and vision-language models train a few GRPO steps, resume, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer.checkpoint import latest_checkpoint, step_dirs
from grouprl.trainer.grpo import GRPOTrainer


@pytest.fixture(scope="module")
def text_setup(say_task):
    return say_task(6)


def text_config(task, out: Path, **overrides) -> dict:
    return task.config(out, [{"name": "accuracy"}, {"name": "length", "weight": 0.5, "kwargs": {"target": 1}}], **{
        "algorithm.adv_estimator": "grpo", "worker.actor.global_batch_size": 4,
        "worker.actor.micro_batch_size_per_device_for_update": 4,
        "worker.actor.micro_batch_size_per_device_for_experience": 16, "trainer.seed": 3, **overrides})


def params_of(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.policy.named_parameters() if v.requires_grad}


def test_text_model_trains_and_writes_run_directory(text_setup, tmp_path):
    trainer = GRPOTrainer(config_from_dict(text_config(text_setup, tmp_path / "run")))
    before = params_of(trainer)
    trainer.train()
    after = params_of(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before), "no parameter moved"
    run = tmp_path / "run"
    assert (run / "config.yaml").exists()
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "rewards/accuracy/mean", "rewards/length/mean", "frac_reward_zero_std",
                "actor/clipfrac", "actor/entropy", "response_length/mean", "response/truncation_rate",
                "timing/step_s", "perf/tokens_per_s", "perf/micro_batches"):
        assert key in metrics[0], key
    assert "perf/micro_batches_per_s" not in metrics[0]  # a mean per optimizer step, not a count made a rate
    rollouts = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 4 * 4
    assert {"prompt", "response", "rewards", "advantage", "score"} <= set(rollouts[0])
    # advantages of one group are centred (GRPO)
    first_group = [r["advantage"] for r in rollouts if r["step"] == 1 and r["group"] == 0]
    assert abs(sum(first_group)) < 1e-4
    assert [s for s, _ in step_dirs(run / "checkpoints")] == [2]


@pytest.mark.parametrize("overrides", [
    {"algorithm.adv_estimator": "rloo", "algorithm.policy_loss": "gspo",
     "algorithm.loss_agg_mode": "seq-mean-token-mean"},
    {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.kl_coef": 0.01, "algorithm.use_kl_loss": False},
    {"algorithm.norm_adv_by_std_in_grpo": False, "algorithm.loss_agg_mode": "seq-mean-token-sum-norm",
     "algorithm.kl_coef": 0.01, "worker.actor.model.lora": {"rank": 4, "alpha": 8}},
    {"algorithm.policy_loss": "cispo", "worker.actor.ppo_epochs": 2, "worker.actor.global_batch_size": 2,
     "algorithm.mask_truncated_completions": True, "algorithm.overlong_buffer": {"enable": True, "length": 2}},
    {"algorithm.online_filtering": True, "algorithm.max_filter_rounds": 1, "algorithm.adv_estimator": "remax"},
    {"algorithm.adv_std_level": "batch"},
    {"worker.actor.model.dtype": "bfloat16", "worker.actor.model.enable_gradient_checkpointing": True,
     "algorithm.policy_loss": "sapo", "algorithm.adv_estimator": "reinforce_plus_plus_baseline"},
])
def test_algorithm_variants_run(text_setup, tmp_path, overrides):
    overrides = {"trainer.max_steps": 1, **overrides}
    trainer = GRPOTrainer(config_from_dict(text_config(text_setup, tmp_path / "run", **overrides)))
    metrics = trainer.train()
    assert all(isinstance(v, float) for v in metrics.values())
    if overrides.get("algorithm.kl_coef") and overrides.get("algorithm.use_kl_loss", True):
        assert "actor/kl_loss" in metrics
    if overrides.get("algorithm.use_kl_loss") is False:
        assert "reward/kl_penalty" in metrics


def test_gradient_accumulation_matches_one_micro_batch(text_setup, tmp_path):
    """The gradient of a mini-batch is the same whether it is split into micro-batches or not."""
    grads = []
    for micro in (16, 3):
        cfg = text_config(text_setup, tmp_path / f"m{micro}", **{
            "trainer.max_steps": 1, "worker.actor.micro_batch_size_per_device_for_update": micro,
            "algorithm.loss_agg_mode": "seq-mean-token-mean"})
        trainer = GRPOTrainer(config_from_dict(cfg))
        seen = {}
        step = trainer.optimizer.step

        def recording_step(*args, **kwargs):
            seen.update({n: p.grad.clone() for n, p in trainer.policy.named_parameters() if p.grad is not None})
            return step(*args, **kwargs)

        trainer.optimizer.step = recording_step
        trainer.train()
        grads.append(seen)
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert any(g.abs().sum() > 0 for g in grads[0].values())
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], rtol=1e-4, atol=1e-7)


def test_padding_free_and_dynamic_batching_give_the_padded_gradient(text_task, tmp_path):
    """Packed rows, micro-batches by tokens and a chunked output layer: the optimizer sees the
    gradient of padded fixed-size micro-batches, and perf/pad_fraction says what was saved."""
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight"]
    # prompts of 1 to 8 words: the padded micro-batches hold left padding
    task = text_task([{"problem": "Say " + " ".join(words[:k]), "answer": words[k - 1]} for k in range(1, 9)], words)
    runs = {}
    for name, overrides in {
        "padded": {"worker.actor.micro_batch_size_per_device_for_update": 3, "worker.actor.log_prob_chunk_tokens": 0},
        "packed": {"worker.actor.padding_free": True, "worker.actor.dynamic_batching": True,
                   "worker.actor.micro_batch_size_per_device_for_update": 2, "worker.actor.log_prob_chunk_tokens": 5},
    }.items():
        cfg = text_config(task, tmp_path / name, **{
            "trainer.max_steps": 1, "algorithm.loss_agg_mode": "seq-mean-token-sum-norm", "algorithm.kl_coef": 0.05,
            "worker.actor.ppo_epochs": 2, **overrides})
        trainer = GRPOTrainer(config_from_dict(cfg))
        seen = []
        step = trainer.optimizer.step

        def recording_step(*args, _seen=seen, _trainer=trainer, _step=step, **kwargs):
            _seen.append({n: p.grad.clone() for n, p in _trainer.policy.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)

        trainer.optimizer.step = recording_step
        runs[name] = (trainer.train(), seen)
    (padded, padded_grads), (packed, packed_grads) = runs["padded"], runs["packed"]
    assert len(padded_grads) == len(packed_grads) == 2  # two epochs: the second sees the old log-probs
    for first, second in zip(padded_grads, packed_grads, strict=True):
        assert any(g.abs().sum() > 0 for g in first.values())
        for key in first:
            torch.testing.assert_close(second[key], first[key], rtol=1e-4, atol=1e-6)
    assert padded["perf/pad_fraction"] > 0.01 and packed["perf/pad_fraction"] == 0.0
    assert padded["perf/micro_batches"] == 6.0 and packed["perf/micro_batches"] >= 1.0  # 16 rows in threes


def test_save_limit_prunes_old_checkpoints(text_setup, tmp_path):
    cfg = text_config(text_setup, tmp_path / "run", **{"trainer.max_steps": 3, "trainer.save_freq": 1,
                                                       "trainer.save_limit": 2})
    GRPOTrainer(config_from_dict(cfg)).train()
    root = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in step_dirs(root)] == [2, 3]
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert not list(root.glob(".*tmp"))


def test_lora_export_merges_adapter(text_setup, tmp_path):
    from grouprl.models.export import export_checkpoint
    from grouprl.models.loading import load_model_and_processor

    cfg = text_config(text_setup, tmp_path / "run", **{"trainer.max_steps": 1,
                                                       "worker.actor.model.lora": {"rank": 4, "alpha": 8}})
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    merged_dir = export_checkpoint(latest_checkpoint(tmp_path / "run" / "checkpoints"), tmp_path / "merged",
                                   base_model=str(text_setup.model))
    merged, _, _ = load_model_and_processor(str(merged_dir))
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, trainer.policy(input_ids=ids).logits,
                                   rtol=1e-4, atol=1e-4)
    assert not (merged_dir / "adapter_config.json").exists()


def test_vlm_trains_with_a_frozen_vision_tower_and_validates(image_task, tmp_path):
    task = image_task(8, format="llava")
    cfg = {
        "data": {"train_files": [str(task.data)], "val_files": [str(task.data)],
                 "max_response_length": 12, "rollout_batch_size": 2, "val_max_samples": 2},
        "worker": {"actor": {"model": {"model_path": str(task.model), "freeze_vision_tower": True},
                             "optim": {"lr": 1e-3}, "global_batch_size": 2},
                   "rollout": {"n": 3},
                   "reward": {"functions": [{"name": "length", "kwargs": {"target": 4}}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "logger": ["jsonl", "tensorboard"],
                    "device": "cpu", "val_freq": 2},
    }
    trainer = GRPOTrainer(config_from_dict(cfg))
    vision_before = {k: v.clone() for k, v in trainer.policy.named_parameters() if "visual" in k}
    trainer.train()
    for k, v in trainer.policy.named_parameters():
        if "visual" in k:
            assert torch.equal(v, vision_before[k]), f"frozen vision parameter {k} moved"
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val/reward/mean" in x for x in lines)
    assert list((tmp_path / "run" / "tensorboard").glob("events.*"))


def test_missing_reward_and_model_are_config_errors(text_setup, tmp_path):
    cfg = text_config(text_setup, tmp_path / "run")
    cfg["worker"]["reward"] = {"functions": []}
    with pytest.raises(ConfigError, match="no reward"):
        GRPOTrainer(config_from_dict(cfg))
    cfg = text_config(text_setup, tmp_path / "run")
    del cfg["worker"]["actor"]["model"]["model_path"]
    with pytest.raises(ConfigError, match="model_path"):
        GRPOTrainer(config_from_dict(cfg))


def test_vlm_checkpoint_weights_round_trip(paths, tmp_path):
    """save_pretrained renames Qwen2.5-VL keys to the hub layout; resuming must map them back."""
    from grouprl.models.loading import load_model_and_processor
    from grouprl.trainer.checkpoint import TrainerState, load_model_weights, save_checkpoint

    model, processor, _ = load_model_and_processor(str(paths["vlm"]))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    path = save_checkpoint(tmp_path / "ck", TrainerState(global_step=1), model, None, None, processor=processor)
    fresh, _, _ = load_model_and_processor(str(paths["vlm"]))
    load_model_weights(fresh, path)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_completions_log_has_tokens_and_sampler_log_probs(text_setup, tmp_path):
    cfg = text_config(text_setup, tmp_path / "run", **{"trainer.max_steps": 1, "trainer.log_completions": True})
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 16
    tokenizer = trainer.processor
    for row in rows:
        assert len(row["tokens"]) == len(row["token_ids"]) == len(row["log_probs"]) > 0
        assert all(lp <= 0 for lp in row["log_probs"])
        assert tokenizer.decode(row["token_ids"], skip_special_tokens=True) == row["completion"]
        assert set(row["rewards"]) == {"accuracy", "length"}


def test_lora_with_trainable_modules_is_refused(text_setup, tmp_path):
    cfg = text_config(text_setup, tmp_path / "run", **{"worker.actor.model.lora": {"rank": 4},
                                                       "worker.actor.model.trainable_modules": ["lm_head"]})
    with pytest.raises(ConfigError, match="trainable_modules.*LoRA"):
        GRPOTrainer(config_from_dict(cfg))


def test_each_policy_loss_gets_its_own_clip_range_from_the_config(text_setup, tmp_path):
    from grouprl.config.algorithm_options import resolve_options

    def policy_loss_options(name, cfg):
        cfg.algorithm.policy_loss = name
        return resolve_options(cfg, "policy_loss")

    cfg = config_from_dict(text_config(text_setup, tmp_path, **{
        "worker.actor.gspo": {"clip_ratio_low": 1e-4, "clip_ratio_high": 2e-4},
        "worker.actor.cispo": {"clip_ratio_low": None, "clip_ratio_high": 4.0},
        "worker.actor.sapo": {"tau_pos": 0.5, "tau_neg": 2.0}}))
    assert policy_loss_options("vanilla", cfg) == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.3, "clip_ratio_dual": 3.0}
    assert policy_loss_options("gspo", cfg) == policy_loss_options("gspo_token", cfg) == {
        "clip_ratio_low": 1e-4, "clip_ratio_high": 2e-4}
    assert policy_loss_options("cispo", cfg) == {"clip_ratio_low": None, "clip_ratio_high": 4.0}
    sapo = policy_loss_options("sapo", cfg)
    assert sapo == {"sapo_tau_pos": 0.5, "sapo_tau_neg": 2.0}  # no clip range: sapo takes none
    # the defaults are each paper's: GSPO 3e-4 / 4e-4, CISPO capped above only (at ratio 5)
    defaults = config_from_dict(text_config(text_setup, tmp_path))
    assert policy_loss_options("gspo", defaults) == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert policy_loss_options("cispo", defaults) == {"clip_ratio_low": None, "clip_ratio_high": 4.0}


@pytest.mark.parametrize("loss", ["gspo", "cispo", "sapo"])
def test_trainer_runs_each_loss_with_its_own_options(text_setup, tmp_path, loss):
    cfg = text_config(text_setup, tmp_path / "run", **{"trainer.max_steps": 1, "algorithm.policy_loss": loss,
                                                       "worker.actor.ppo_epochs": 2})
    metrics = GRPOTrainer(config_from_dict(cfg)).train()
    assert metrics["actor/skipped_step"] == 0 and "actor/clipfrac" in metrics


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_follows_norm_adv_by_std(text_setup, tmp_path, norm):
    from types import SimpleNamespace

    from grouprl import algorithms
    from grouprl.trainer.grpo import GRPOTrainer as Trainer

    cfg = config_from_dict(text_config(text_setup, tmp_path, **{"algorithm.adv_estimator": "grpo_passk",
                                                                 "algorithm.norm_adv_by_std_in_grpo": norm}))
    scores = torch.tensor([1.0, 0.0, 0.5, 0.2])
    from grouprl.config.algorithm_options import resolve_options
    from grouprl.trainer.metrics import StepMetrics

    batch = SimpleNamespace(loss_mask=torch.ones(4, 3), group_index=torch.zeros(4, dtype=torch.long), scores=scores,
                            reward_components={"r": scores.tolist()})
    trainer = SimpleNamespace(config=cfg, rewards=SimpleNamespace(weights={"r": 1.0}),
                              accelerator=SimpleNamespace(num_processes=1),
                              estimator_options=resolve_options(cfg, "adv_estimator"))
    got = Trainer._advantages(trainer, scores, batch, None, StepMetrics())
    want = algorithms.compute_advantages("grpo_passk", scores, batch.group_index, norm_by_std=norm,
                                         response_mask=batch.loss_mask)
    torch.testing.assert_close(got, want)
    assert got[0, 0] == pytest.approx(0.5 / (float(scores.std()) + 1e-6) if norm else 0.5, rel=1e-5)
