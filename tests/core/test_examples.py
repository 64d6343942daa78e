"""The recipes of examples/: each loads as a config with the seed's numbers, and each runs one
step on the tiny model and synthetic data through the overrides examples/run_tiny.sh uses."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grouprl.cli import main
from grouprl.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(p.name for p in EXAMPLES.glob("*.yaml"))


def _tiny_setup():
    spec = importlib.util.spec_from_file_location("tiny_setup", EXAMPLES / "tiny_setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tiny_setup = _tiny_setup()

# What each recipe must say: the seeds' numbers (EditGRPO paper / launch script, CheX-Phi4MM train_loop.sh).
EDITGRPO_COMMON = {
    "data.format": "llava", "data.rollout_batch_size": 32, "worker.rollout.n": 5, "worker.rollout.temperature": 1.0,
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.weight_decay": 1e-2, "worker.actor.max_grad_norm": 1.0,
    "algorithm.kl_coef": 1e-2, "algorithm.kl_penalty": "low_var_kl", "algorithm.use_kl_loss": True,
    "worker.actor.ppo_epochs": 1, "worker.actor.global_batch_size": 32, "worker.actor.model.freeze_vision_tower": True,
    "worker.actor.model.dtype": "bfloat16", "worker.reward.reward_server": "http://127.0.0.1:5000/predict",
    "worker.reward.reward_components": ["radgraphf1", "cxb14micro", "ratescore"], "worker.reward.type": "free_form",
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
        "worker.rollout.verifier.temperature": 0.2, "worker.rollout.verifier.top_p": 0.95,
        "worker.rollout.verifier.max_tokens": 256, "worker.rollout.verifier.train_scope": "full_turn",
        "worker.rollout.verifier.api_key": None,  # from $GROUPRL_VERIFIER_API_KEY, never in the recipe
    },
}
EDIT_KEYS = {"extractor": True, "extractor_num_ops_per_para": 1, "extractor_num_para": -1,
             "extractor_similarity_threshold": 0.6, "extractor_type": "rules"}


FLOW_COMMON = {  # MM-GRPO's run_sd3.sh / run_sd3_fast.sh
    "worker.actor.model.lora.rank": 32, "worker.actor.model.lora.alpha": 64, "worker.rollout.n": 16,
    "data.rollout_batch_size": 64, "worker.rollout.height": 512, "worker.rollout.num_steps": 10,
    "worker.actor.optim.weight_decay": 1e-4, "trainer.total_epochs": 15, "trainer.val_freq": 5,
    "trainer.save_freq": 100, "data.val_max_samples": 256, "worker.actor.num_minibatches": 2,
}
EXPECTED["flow_grpo_sd35m_ocr.yaml"] = {
    **FLOW_COMMON, "algorithm.name": "flow_grpo", "worker.actor.optim.lr": 3e-4, "algorithm.kl_coef": 0.04,
    "worker.rollout.guidance_scale": 4.5, "worker.rollout.noise_level": 0.7, "worker.rollout.kind": "sde",
    "algorithm.clip_range": 1e-4,
}
EXPECTED["flow_grpo_fast_sd35m_ocr.yaml"] = {
    **FLOW_COMMON, "algorithm.name": "flow_grpo_fast", "worker.actor.optim.lr": 1e-4, "algorithm.kl_coef": 0.0,
    "worker.rollout.guidance_scale": 1.0, "worker.rollout.noise_level": 0.8, "worker.rollout.kind": "cps",
    "worker.rollout.sde_window_size": 3, "worker.rollout.sde_window_range": [0, 5], "algorithm.clip_range": 1e-5,
}


def load_recipe(path):
    """A recipe's config, read with the flow trainer's schema when it says `kind: flow`."""
    if tiny_setup.is_flow(path):
        from grouprl.domains.diffusion.config import load_flow_config

        return load_flow_config(path)
    return load_config(path)


def _get(config, dotted: str):
    node = config
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_every_recipe_is_checked():
    assert sorted(EXPECTED) == RECIPES


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_loads_with_the_seed_settings(recipe):
    config = load_recipe(EXAMPLES / recipe)  # unknown keys or bad values would raise here
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


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tiny_setup.build(root)
    return root


def test_tiny_vqa_data(tiny_root):
    from grouprl.data import load_samples
    from grouprl.domains.radiology.rewards.answers import answer_labels

    records = [json.loads(line) for line in (tiny_root / "vqa" / "data.jsonl").read_text().splitlines()]
    studies = json.loads((tiny_root / "vqa" / "studies.json").read_text())
    for record, study in zip(records, studies):
        present = {k.replace("_", " ") for k, v in study["findings"].items() if v == 1}
        assert answer_labels(record["answer"]) == (present or {"no finding"})
        assert record["question_type"] == "findings"
        assert record["reasoning"] == study["conversations"][-1]["value"]
    samples = load_samples(tiny_root / "vqa" / "data.jsonl")
    assert len(samples) == len(records) and len(samples[0].images) == 1
    assert samples[0].answer == records[0]["solution"]  # answer_set_f1 reads its <answer>, kg its <think>


def test_overrides_follow_the_recipe(tiny_root):
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
def test_recipe_runs_one_tiny_step(recipe, tiny_root, tmp_path):
    out = tmp_path / "run"
    if tiny_setup.is_flow(EXAMPLES / recipe):
        tiny_setup.build_flow(tiny_root)
    overrides = tiny_setup.overrides(EXAMPLES / recipe, tiny_root, out)
    assert main(["train", str(EXAMPLES / recipe), *overrides, "trainer.max_steps=1"]) == 0
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    step = metrics[0]
    if tiny_setup.is_flow(EXAMPLES / recipe):
        # the recipe's algorithm, sampler and reward reached the run; the update ran
        saved = yaml.safe_load((out / "config.yaml").read_text())
        recipe_config = load_recipe(EXAMPLES / recipe)
        assert saved["algorithm"] == dataclasses.asdict(recipe_config.algorithm)
        for key in ("kind", "noise_level", "guidance_scale", "sde_window_size", "sde_window_range"):
            assert saved["worker"]["rollout"][key] == getattr(recipe_config.worker.rollout, key)
        assert "rewards/ocr/mean" in step and "actor/pg_loss" in step and "actor/grad_norm" in step
        assert ("actor/kl_loss" in step) == (recipe_config.algorithm.kl_coef > 0)
        return
    assert step["actor/skipped_step"] == 0 and "actor/pg_loss" in step  # the update ran
    saved = yaml.safe_load((out / "config.yaml").read_text())
    recipe_config = load_config(EXAMPLES / recipe)
    # the recipe's algorithm reached the run (the tiny overrides only touch sizes, paths and devices)
    for key in ("adv_estimator", "norm_adv_by_std_in_grpo", "loss_agg_mode", "kl_coef", "kl_penalty"):
        assert saved["algorithm"][key] == getattr(recipe_config.algorithm, key)
    if recipe == "guided_grpo_qwen3vl8b.yaml":
        # the rollouts were dialogues with the rule verifier, scored by Guided-GRPO's reward
        assert saved["worker"]["rollout"]["verifier"]["backend"] == "rule"
        assert "rewards/guided/mean" in step and "multiturn/turns_mean" in step and "verifier/failures" in step
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
def test_run_tiny_script(tiny_root):
    env = dict(os.environ, PYTHON=sys.executable, TINY_DIR=str(tiny_root))
    done = subprocess.run(["bash", str(EXAMPLES / "run_tiny.sh"), str(EXAMPLES / "drgrpo_qwen25vl3b.yaml"),
                           "trainer.max_steps=1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tiny_root / "runs" / "drgrpo_qwen25vl3b"
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    assert "grouprl train" in done.stdout and "worker.reward.functions" in done.stdout
