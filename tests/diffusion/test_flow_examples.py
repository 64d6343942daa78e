"""The flow-matching recipes of examples/ (`kind: flow`): each loads with its source's numbers (MM-GRPO's
for Flow-GRPO and Fast, verl-omni's for GRPO-Guard, NVlabs' for DiffusionNFT), and each runs one step on the tiny SD3.5-shaped
pipeline (two CLIPs, T5, VAE) through the overrides examples/run_tiny.sh uses.

The other recipes: tests/core/test_examples.py."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from grouprl.domains.diffusion.config import load_flow_config

FLOW_COMMON = {  # MM-GRPO's run_sd3.sh / run_sd3_fast.sh
    "worker.actor.model.lora.rank": 32, "worker.actor.model.lora.alpha": 64, "worker.rollout.n": 16,
    "data.rollout_batch_size": 64, "worker.rollout.height": 512, "worker.rollout.num_steps": 10,
    "worker.actor.optim.weight_decay": 1e-4, "trainer.total_epochs": 15, "trainer.val_freq": 5,
    "trainer.save_freq": 100, "data.val_max_samples": 256, "worker.actor.num_minibatches": 2,
    "worker.actor.ema.enabled": True, "worker.actor.ema.decay": 0.9,  # flow_grpo's SD3 configs
}
EXPECTED = {
    "flow_grpo_sd35m_ocr.yaml": {
        **FLOW_COMMON, "algorithm.name": "flow_grpo", "worker.actor.optim.lr": 3e-4, "algorithm.kl_coef": 0.04,
        "worker.rollout.guidance_scale": 4.5, "worker.rollout.noise_level": 0.7, "worker.rollout.kind": "sde",
        "algorithm.clip_range": 1e-4,
    },
    "flow_grpo_fast_sd35m_ocr.yaml": {
        **FLOW_COMMON, "algorithm.name": "flow_grpo_fast", "worker.actor.optim.lr": 1e-4, "algorithm.kl_coef": 0.0,
        "worker.rollout.guidance_scale": 1.0, "worker.rollout.noise_level": 0.8, "worker.rollout.kind": "cps",
        "worker.rollout.sde_window_size": 3, "worker.rollout.sde_window_range": [0, 5],
        "algorithm.clip_range": 1e-5,
    },
    # verl-omni's examples/grpoguard_trainer/qwen_image/run_qwen_image_ocr_lora.sh and its rollout and
    # actor defaults (10 steps at 512 px, no KL); the SDE window it sets has no grpo_guard key here
    "flow_grpo_guard_sd35m_ocr.yaml": {
        "algorithm.name": "grpo_guard", "algorithm.clip_range": 2e-6, "algorithm.adv_clip_max": 5.0,
        "algorithm.kl_coef": 0.0, "algorithm.global_std": True, "data.rollout_batch_size": 32,
        "worker.rollout.n": 16, "worker.actor.num_minibatches": 2, "worker.actor.micro_batch_size": 16,
        "worker.actor.model.lora.rank": 64, "worker.actor.model.lora.alpha": 128,
        "worker.actor.optim.lr": 3e-4, "worker.actor.optim.weight_decay": 1e-4,
        "worker.rollout.kind": "sde", "worker.rollout.noise_level": 1.2, "worker.rollout.guidance_scale": 4.0,
        "worker.rollout.num_steps": 10, "worker.rollout.height": 512, "worker.rollout.width": 512,
        "worker.rollout.val_num_steps": 50, "worker.rollout.val_images_to_log": 8,
        "worker.actor.model.dtype": "bfloat16", "trainer.total_epochs": 15, "trainer.max_steps": 300,
        "trainer.val_freq": 30, "trainer.save_freq": 30, "trainer.val_before_train": False,
    },
    # NVlabs' config/nft.py sd3_ocr (with _get_config's SD3 defaults) and base.py
    "diffusion_nft_sd35m_ocr.yaml": {
        "algorithm.name": "diffusion_nft", "algorithm.nft.beta": 0.1, "algorithm.nft.adaptive_weighting": True,
        "algorithm.nft.decay_flat": 75, "algorithm.nft.decay_rate": 0.0075, "algorithm.nft.decay_ceiling": 0.999,
        "algorithm.kl_coef": 1e-4, "algorithm.adv_clip_max": 5.0, "algorithm.timestep_fraction": 0.99,
        "algorithm.global_std": True, "data.rollout_batch_size": 48, "worker.rollout.n": 24,
        "worker.rollout.num_steps": 10, "worker.rollout.val_num_steps": 40, "worker.rollout.guidance_scale": 1.0,
        "worker.rollout.noise_level": 0.0, "worker.rollout.height": 512, "worker.actor.optim.lr": 3e-4,
        "worker.actor.optim.weight_decay": 1e-4, "worker.actor.max_grad_norm": 1.0,
        "worker.actor.model.lora.rank": 32, "worker.actor.model.lora.alpha": 64, "worker.actor.num_minibatches": 2,
        "worker.actor.ema.enabled": True, "worker.actor.ema.decay": 0.9, "worker.actor.ema.update_interval": 1,
    },
}
# verl-omni's LoRA targets for Qwen-Image (attention and MLPs), under SD3's names
GUARD_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                      "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
RECIPES = sorted(EXPECTED)
# recipes of other model families, checked with their family's tiny stand-in in that family's test file
OTHER_FAMILIES = {"flow_grpo_flux.yaml": "tests/diffusion/test_family_flux.py",
                  "flow_grpo_wan.yaml": "tests/diffusion/test_family_wan.py",
                  "flow_grpo_qwen_image.yaml": "tests/diffusion/test_family_qwen_image.py"}


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_every_flow_recipe_is_checked(tiny_examples):
    flow = [p.name for p in sorted(tiny_examples.dir.glob("*.yaml")) if tiny_examples.setup.is_flow(p)]
    assert [name for name in flow if name not in OTHER_FAMILIES] == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_flow_recipe_loads_with_the_seed_settings(recipe, tiny_examples):
    config = load_flow_config(tiny_examples.dir / recipe)  # unknown keys or bad values would raise here
    for key, value in EXPECTED[recipe].items():
        assert _get(config, key) == value, key


def test_guard_recipe_lora_targets_are_verl_omnis_on_sd3(tiny_examples):
    config = load_flow_config(tiny_examples.dir / "flow_grpo_guard_sd35m_ocr.yaml")
    assert config.worker.actor.model.lora.target_modules == GUARD_LORA_TARGETS


def test_flow_recipes_tiny_model_is_sd3_with_t5_and_vae(tiny_examples):
    from grouprl.domains.diffusion.models import load_flow_model

    root = tiny_examples.built(RECIPES[0])
    model = load_flow_model(root / tiny_examples.setup.MODELS["ocr"], max_sequence_length=16)
    assert model.pipeline is not None and model.vae is not None
    assert [type(e).__name__ for e in model.text_encoders] == [
        "CLIPTextModelWithProjection", "CLIPTextModelWithProjection", "T5EncoderModel"]
    embeds, _ = model.encode_prompts(['A sign that says "HELLO"'])
    # CLIP's 77 tokens, then T5's: real T5 states, not the zeros SD3 puts there without T5
    assert embeds.shape[1] == 77 + 16 and embeds[0, 77:].abs().sum() > 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_flow_recipe_runs_one_tiny_step(recipe, tiny_examples, tmp_path):
    out = tmp_path / "run"
    step = tiny_examples.run_one_step(recipe, out)
    # the recipe's algorithm, sampler and reward reached the run; the update ran
    saved = yaml.safe_load((out / "config.yaml").read_text())
    recipe_config = load_flow_config(tiny_examples.dir / recipe)
    assert saved["algorithm"] == dataclasses.asdict(recipe_config.algorithm)
    for key in ("kind", "noise_level", "guidance_scale", "sde_window_size", "sde_window_range"):
        assert saved["worker"]["rollout"][key] == getattr(recipe_config.worker.rollout, key)
    assert "rewards/ocr/mean" in step and "actor/pg_loss" in step and "actor/grad_norm" in step
    assert ("actor/kl_loss" in step) == (recipe_config.algorithm.kl_coef > 0)
