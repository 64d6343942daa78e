"""Precision as a policy: fp32 master weights and AdamW state with bf16 compute, unless pure bf16 is asked for."""

from __future__ import annotations

import json

import pytest
import torch

from grouprl.config import ConfigError, config_from_dict
from grouprl.trainer.grpo import GRPOTrainer
from grouprl.trainer.precision import precision_policy

NOISY_REWARD = '''
def by_length(prompts, completions, **kwargs):
    return [(len(c) % 4) / 3 for c in completions]
'''


@pytest.fixture(scope="module")
def setup(say_task, tmp_path_factory):
    reward = tmp_path_factory.mktemp("precision") / "reward.py"
    reward.write_text(NOISY_REWARD)
    return {"task": say_task(4), "reward": reward}


def config(setup, out, *, dtype="float32", strategy="adamw", lr=1e-6, **extra) -> dict:
    return setup["task"].config(out, [{"name": f"{setup['reward']}:by_length"}], **{
        "worker.actor.model.dtype": dtype, "worker.actor.optim.lr": lr, "worker.actor.optim.strategy": strategy,
        "worker.actor.global_batch_size": 2, "worker.actor.micro_batch_size_per_device_for_update": 4,
        "trainer.max_steps": 5, "trainer.log_rollouts": False, **extra})


def updates(trainer) -> dict[str, torch.Tensor]:
    """Train and return each parameter's total change, in fp32."""
    before = {k: v.detach().float().clone() for k, v in trainer.policy.named_parameters()}
    trainer.train()
    return {k: v.detach().float() - before[k] for k, v in trainer.policy.named_parameters()}


def test_bf16_compute_at_lr_1e6_updates_like_fp32(setup, tmp_path):
    """10 AdamW steps at lr 1e-6: bf16 compute over fp32 masters changes the same entries, by the same amount."""
    fp32 = updates(GRPOTrainer(config_from_dict(config(setup, tmp_path / "fp32"))))
    mixed = updates(GRPOTrainer(config_from_dict(config(setup, tmp_path / "mixed", dtype="bfloat16"))))
    pure = updates(GRPOTrainer(config_from_dict(config(setup, tmp_path / "pure", dtype="bfloat16",
                                                       strategy="adamw_bf16"))))
    matrices = [k for k, v in fp32.items() if v.dim() == 2]
    for key in matrices:
        changed_fp32, changed_mixed = fp32[key] != 0, mixed[key] != 0
        assert changed_fp32.float().mean() > 0.99, key
        # the same entries change (a few at the edge of fp32's resolution may round either way)
        assert (changed_fp32 == changed_mixed).float().mean() > 0.999, key
        assert mixed[key].norm() == pytest.approx(float(fp32[key].norm()), rel=0.03), key
        # pure bf16, the explicit lossy choice, loses most of these updates to rounding
        assert (pure[key] != 0).float().mean() < 0.2, key
    total = torch.cat([v.flatten() for v in fp32.values()]).norm()
    assert torch.cat([v.flatten() for v in mixed.values()]).norm() == pytest.approx(float(total), rel=0.01)


def test_mixed_precision_keeps_fp32_masters_and_bf16_copies(setup, tmp_path):
    cfg = config(setup, tmp_path / "run", dtype="bfloat16", lr=1e-3, **{"trainer.max_steps": 2,
                                                                      "algorithm.kl_coef": 0.01})
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    states = [s for s in trainer.optimizer.state.values() if s]
    assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    assert all(p.dtype == torch.bfloat16 for p in trainer.ref_model.model.parameters())
    # generation samples from a bf16 copy that follows the trained master weights
    copy = dict(trainer.engine.model.named_parameters())
    assert trainer.engine.holds_weights and trainer.engine.model is not trainer.policy
    for name, master in trainer.policy.named_parameters():
        assert copy[name].dtype == torch.bfloat16
        assert torch.equal(copy[name], master.detach().to(torch.bfloat16)), name
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["precision"] == "trained weights and optimizer state fp32, compute bf16, frozen weights bf16"
    assert info["rollout_weights"] == "copy"


def test_lora_adapters_and_their_state_are_fp32_over_a_bf16_base(setup, tmp_path):
    cfg = config(setup, tmp_path / "run", dtype="bfloat16", lr=1e-3, **{
        "trainer.max_steps": 1, "algorithm.kl_coef": 0.01, "worker.actor.model.lora": {"rank": 4, "alpha": 8}})
    trainer = GRPOTrainer(config_from_dict(cfg))
    trainer.train()
    trained = [p for p in trainer.policy.parameters() if p.requires_grad]
    frozen = [p for p in trainer.policy.parameters() if not p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)
    assert frozen and all(p.dtype == torch.bfloat16 for p in frozen)
    assert all(s["exp_avg"].dtype == torch.float32 for s in trainer.optimizer.state.values() if s)
    assert trainer.ref_model is None and not trainer.engine.holds_weights  # adapters off / on, one model


def test_precision_modes():
    fp32, mixed, pure = (precision_policy("float32"), precision_policy("bfloat16"),
                         precision_policy("bfloat16", "adamw_bf16"))
    assert (fp32.param_dtype, fp32.compute_dtype, fp32.mixed, fp32.rollout_copy) == (torch.float32,) * 2 + (False, False)
    assert (mixed.param_dtype, mixed.compute_dtype, mixed.frozen_dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    assert mixed.mixed and mixed.rollout_copy and mixed.load_dtype == torch.float32
    assert pure.param_dtype == pure.compute_dtype == torch.bfloat16 and not pure.mixed
    lora = precision_policy("bfloat16", lora=True)
    assert lora.load_dtype == torch.bfloat16 and lora.param_dtype == torch.float32 and not lora.rollout_copy
    assert precision_policy("auto", checkpoint_dtype=torch.bfloat16) == mixed
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        with mixed.autocast("cpu"):
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
        with fp32.autocast("cpu"):
            assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("overrides, message", [
    ({"worker.actor.optim.strategy": "adamw_bf16"}, "adamw_bf16.*bfloat16"),
    ({"worker.actor.model.dtype": "float16"}, "float16 training needs loss scaling"),
    ({"worker.rollout.temperature": 0}, "worker.rollout.temperature' must be > 0"),
    ({"worker.actor.strategy": "fsdp", "worker.actor.model.lora": {"rank": 4}}, "fsdp with LoRA"),
])
def test_precision_and_rollout_settings_are_checked_at_load(setup, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(config(setup, tmp_path, **overrides))
