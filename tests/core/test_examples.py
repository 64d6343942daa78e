"""The recipes of examples/: each loads as a config with the seed's numbers, and each runs one
step on the tiny model and synthetic data through the overrides examples/run_tiny.sh uses.

The flow-matching recipes (`kind: flow`): tests/diffusion/test_flow_examples.py; the VQA data the
tiny setup writes for CheXPO: tests/radiology/test_tiny_vqa_example.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grouprl.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _tiny_setup():
    spec = importlib.util.spec_from_file_location("tiny_setup", EXAMPLES / "tiny_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_setup = _tiny_setup()
# a Kubernetes manifest (apiVersion: the PyTorchJob of tests/core/test_multinode.py) is no recipe
RECIPES = sorted(p.name for p in EXAMPLES.glob("*.yaml")
                 if not tiny_setup.is_flow(p) and "apiVersion" not in (yaml.safe_load(p.read_text()) or {}))

# What each recipe must say: the seeds' numbers (EditGRPO paper / launch script, CheX-Phi4MM train_loop.sh).
EDITGRPO_COMMON = {
    "data.format": "llava", "data.rollout_batch_size": 32, "worker.rollout.n": 5, "worker.rollout.temperature": 1.0,
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.weight_decay": 1e-2, "worker.actor.max_grad_norm": 1.0,
    "algorithm.kl_coef": 1e-2, "algorithm.kl_penalty": "low_var_kl", "algorithm.use_kl_loss": True,
    "worker.actor.ppo_epochs": 1, "worker.actor.global_batch_size": 32, "worker.actor.model.freeze_vision_tower": True,
    "worker.actor.model.dtype": "bfloat16", "worker.reward.reward_server": "http://127.0.0.1:5000/predict",
    "worker.reward.reward_components": ["radgraphf1", "cxb14micro", "ratescore"], "worker.reward.type": "free_form",
    "worker.actor.padding_free": True, "worker.actor.dynamic_batching": False,  # EditGRPO's EasyR1 config
}
EXPECTED = {
    "editgrpo_qwen25vl3b.yaml": {**EDITGRPO_COMMON, "algorithm.norm_adv_by_std_in_grpo": False,
                                 "algorithm.loss_agg_mode": "seq-mean-token-sum-norm",
                                 "worker.rollout.extractor": True, "worker.rollout.extractor_num_ops_per_para": 1,
                                 "worker.rollout.extractor_num_para": -1,
                                 "worker.rollout.extractor_similarity_threshold": 0.6,
                                 "worker.rollout.extractor_type": "rules", "algorithm.force_gt_num": 0},
    "drgrpo_qwen25vl3b.yaml": {**EDITGRPO_COMMON, "algorithm.norm_adv_by_std_in_grpo": False,
                               "algorithm.loss_agg_mode": "seq-mean-token-sum-norm", "worker.rollout.extractor": False},
    "grpo_qwen25vl3b.yaml": {**EDITGRPO_COMMON, "algorithm.norm_adv_by_std_in_grpo": True,
                             "algorithm.loss_agg_mode": "token-mean"},
    "chexpo_v2.yaml": {
        "worker.rollout.n": 8, "worker.rollout.temperature": 0.9, "worker.actor.optim.lr": 4e-6,
        "algorithm.kl_coef": 0.5, "worker.actor.clip_ratio_low": 0.2, "worker.actor.clip_ratio_high": 0.2,
        "data.max_response_length": 256, "algorithm.online_filtering": True, "algorithm.filter_min_std": 0.06,
        "algorithm.norm_adv_by_std_in_grpo": True, "trainer.log_completions": True,
        "worker.reward.reward_server": None,
    },
    # Guided-GRPO's examples/config_multi_turn.yaml, with config_multi_turn_http.yaml's HTTP verifier
    "guided_grpo_qwen3vl8b.yaml": {
        "worker.actor.model.model_path": "Qwen/Qwen3-VL-8B-Instruct", "worker.rollout.n": 8,
        "worker.rollout.temperature": 1.0, "worker.actor.optim.lr": 5e-6, "worker.actor.optim.weight_decay": 1e-2,
        "algorithm.use_kl_loss": True, "algorithm.kl_penalty": "low_var_kl", "algorithm.kl_coef": 1e-3,
        "data.rollout_batch_size": 512, "worker.actor.global_batch_size": 128, "data.max_prompt_length": 12800,
        "data.max_response_length": 2048, "worker.actor.max_grad_norm": 1.0,
        "worker.rollout.verifier.enable": True, "worker.rollout.verifier.use_http": True,
        "worker.rollout.verifier.max_turns": 10, "worker.rollout.verifier.stop_token": "###STOP###",
        "worker.rollout.verifier.max_tokens_per_turn": None, "worker.rollout.verifier.max_dialogue_tokens": None,
        "worker.rollout.verifier.temperature": 0.0, "worker.rollout.verifier.top_p": 0.95,
        "worker.rollout.verifier.max_tokens": 256, "worker.rollout.verifier.train_scope": "full_turn",
        "worker.rollout.verifier.api_key": None,  # from $GROUPRL_VERIFIER_API_KEY, never in the recipe
        "worker.actor.padding_free": True, "worker.actor.dynamic_batching": True,
    },
}
EDIT_KEYS = {"extractor": True, "extractor_num_ops_per_para": 1, "extractor_num_para": -1,
             "extractor_similarity_threshold": 0.6, "extractor_type": "rules"}


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_every_recipe_is_checked():
    assert sorted(EXPECTED) == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_with_the_seed_settings(recipe):
    config = load_config(EXAMPLES / recipe)  # unknown keys or bad values would raise here
    for key, value in EXPECTED[recipe].items():
        assert _get(config, key) == value, key


def test_chexpo_rewards_are_format_answer_and_kg_one_to_one():
    config = load_config(EXAMPLES / "chexpo_v2.yaml")
    specs = [(f.name, f.weight, f.kwargs) for f in config.worker.reward.functions]
    assert specs == [("format", 1.0, {"style": "think_answer"}), ("answer_set_f1", 1.0, {}),
                     ("kg_consistency", 1.0, {})]
    from grouprl.rewards.registry import get_reward

    for name, _, _ in specs:
        assert get_reward(name) is not None


def test_editgrpo_differs_from_drgrpo_only_by_the_edits():
    edit, dr = (yaml.safe_load((EXAMPLES / name).read_text())
                for name in ("editgrpo_qwen25vl3b.yaml", "drgrpo_qwen25vl3b.yaml"))
    rollout = edit["worker"]["rollout"]
    assert {k: rollout.pop(k) for k in list(EDIT_KEYS)} == EDIT_KEYS
    assert rollout.pop("extractor_edited_tokens") == "train"
    assert edit["algorithm"].pop("force_gt_num") == 0
    for config in (edit, dr):
        config["trainer"].pop("experiment_name")
    assert edit == dr


# ---------------------------------------------------------------------------- tiny runs


def test_overrides_follow_the_recipe(tiny_examples):
    tiny_root = tiny_examples.built()
    edit = tiny_setup.overrides(EXAMPLES / "editgrpo_qwen25vl3b.yaml", tiny_root)
    chexpo = tiny_setup.overrides(EXAMPLES / "chexpo_v2.yaml", tiny_root)
    assert f"data.train_files=['{tiny_root.resolve() / 'reports' / 'data.json'}']" in edit
    assert f"data.train_files=['{tiny_root.resolve() / 'vqa' / 'data.jsonl'}']" in chexpo
    assert "worker.reward.reward_server=null" in edit and "worker.reward.reward_server=null" not in chexpo
    assert "algorithm.filter_min_std=0.0" in chexpo and "algorithm.filter_min_std=0.0" not in edit
    guided = tiny_setup.overrides(EXAMPLES / "guided_grpo_qwen3vl8b.yaml", tiny_root)
    assert f"data.train_files=['{tiny_root.resolve() / 'math' / 'data.jsonl'}']" in guided
    assert "worker.rollout.verifier.backend=rule" in guided and "worker.rollout.verifier.backend=rule" not in edit
    assert not any("@" in line for line in edit + chexpo + guided)


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_one_tiny_step(recipe, tiny_examples, tmp_path):
    out = tmp_path / "run"
    step = tiny_examples.run_one_step(recipe, out)
    assert step["actor/skipped_step"] == 0 and "actor/pg_loss" in step  # the update ran
    saved = yaml.safe_load((out / "config.yaml").read_text())
    recipe_config = load_config(EXAMPLES / recipe)
    # the recipe's algorithm reached the run (the tiny overrides only touch sizes, paths and devices)
    for key in ("adv_estimator", "norm_adv_by_std_in_grpo", "loss_agg_mode", "kl_coef", "kl_penalty"):
        assert saved["algorithm"][key] == getattr(recipe_config.algorithm, key)
    if recipe == "guided_grpo_qwen3vl8b.yaml":
        # the rollouts were dialogues with the rule verifier, scored by Guided-GRPO's reward
        assert saved["worker"]["rollout"]["verifier"]["backend"] == "rule"
        assert "rewards/guided/mean" in step and "multiturn/turns" in step and "verifier/failures" in step
        rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
        assert rollouts and all(r["dialogue"] and r["spans"] and r["stop_reason"] for r in rollouts)
        assert all(1 <= r["num_turns"] <= 2 for r in rollouts)
    elif recipe == "chexpo_v2.yaml":
        for name in ("format", "answer_set_f1", "kg_consistency"):
            assert f"rewards/{name}/mean" in step
        assert saved["worker"]["actor"]["model"]["lora"]["rank"] == 64
        completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
        assert completions and all(len(c["tokens"]) == len(c["log_probs"]) > 0 for c in completions)
    else:
        assert "rewards/editgrpo_composite/mean" in step
        assert step["actor/kl"] >= 0  # KL to the reference model is on in every EditGRPO recipe
        edits_on = recipe == "editgrpo_qwen25vl3b.yaml"
        assert ("edits/edit_rate" in step) == edits_on
        if edits_on:  # n=2: floor(2/2) = 1 edited copy per group
            rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
            assert step["edits/edit_rate"] > 0 and any(r["edited"] for r in rollouts)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_tiny_script(tiny_examples):
    tiny_root = tiny_examples.built()
    env = dict(os.environ, PYTHON=sys.executable, TINY_DIR=str(tiny_root))
    done = subprocess.run(["bash", str(EXAMPLES / "run_tiny.sh"), str(EXAMPLES / "drgrpo_qwen25vl3b.yaml"),
                           "trainer.max_steps=1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tiny_root / "runs" / "drgrpo_qwen25vl3b"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "grouprl train" in done.stdout and "worker.reward.functions" in done.stdout
