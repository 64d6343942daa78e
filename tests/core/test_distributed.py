"""Two real processes on the CPU: `torchrun --nproc_per_node 2` with gloo.

(`accelerate launch --cpu --num_processes 2` starts one process, so it cannot test
this.) Each test checks the world size the processes really had.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

HERE = Path(__file__).parent
REWARDS = HERE / "distributed" / "rank_rewards.py"


def torchrun(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}"
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_update_on_two_processes_matches_the_whole_batch_on_one(tmp_path):
    """Same gradients as one process with the whole batch; pg_loss and kl_loss logged at their true value."""
    from grouprl.models.tiny import build_tiny_text_lm

    model = build_tiny_text_lm(tmp_path / "model", ["a b c d e f g h i j k l"], seed=0)
    torchrun(str(HERE / "distributed" / "grad_check.py"), str(model), str(tmp_path / "out"), cwd=tmp_path)
    for rank in (0, 1):
        result = json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())
        assert result["world_size"] == 2 and result["rank"] == rank
        assert set(result["modes"]) == {"token-mean", "seq-mean-token-sum-norm"}
        for mode, r in result["modes"].items():
            assert r["same_parameters"], mode
            assert r["max_abs_grad"] > 1e-3, mode  # a real gradient, not zeros compared with zeros
            assert r["max_abs_grad_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), (mode, r)
            assert r["pg_loss_logged"] == pytest.approx(r["pg_loss_whole"], rel=1e-5), mode
            assert r["kl_loss_logged"] == pytest.approx(r["kl_loss_whole"], rel=1e-5), mode
        # a key only one process logs stops both with its name, instead of a size mismatch or a hang
        assert "only_on_rank_1" in result["schema_error"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from grouprl.domains.radiology.synthetic.cxr import corpus, write_dataset
    from grouprl.models.tiny import build_tiny_vlm

    root = tmp_path_factory.mktemp("vlm2")
    data = write_dataset(root / "cxr", 4, seed=0, format="easyr1")
    images = [json.loads(x) for x in data.read_text().splitlines()]
    for r in images:
        r["images"] = [str(data.parent / p) for p in r["images"]]
    texts = [{"id": f"text{i}", "problem": f"Write a normal chest X-ray report, version {i}.",
              "answer": "No acute cardiopulmonary process. Heart size is normal."} for i in range(4)]
    # unshuffled, each process's shard of a step holds one study with an image and one without
    mixed = [images[0], images[1], texts[0], texts[1], images[2], images[3], texts[2], texts[3]]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    (root / "val.jsonl").write_text(json.dumps(images[0]) + "\n")  # one sample: process 1 validates none
    return {"root": root, "model": build_tiny_vlm(root / "model", corpus(), seed=0)}


def test_two_processes_train_a_vlm_with_a_trainable_vision_tower(vlm, tmp_path):
    """Mixed image / text-only data, a reward that applies to no row of one process, dynamic sampling, validation."""
    config = {
        "data": {"train_files": [str(vlm["root"] / "train.jsonl")], "val_files": [str(vlm["root"] / "val.jsonl")],
                 "max_response_length": 6, "rollout_batch_size": 4, "shuffle": False},
        # no extra rounds: process 1 ends each step with fewer kept groups than process 0
        "algorithm": {"online_filtering": True, "max_filter_rounds": 0},
        "worker": {"actor": {"model": {"model_path": str(vlm["model"]), "freeze_vision_tower": False},
                             "optim": {"lr": 1e-3}, "global_batch_size": 2,
                             "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 4},
                   "reward": {"functions": [{"name": f"{REWARDS}:rank_zero_only"},
                                            {"name": f"{REWARDS}:images_on_rank_one"}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "logger": ["jsonl"], "device": "cpu",
                    "val_freq": 1},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", str(tmp_path / "config.yaml"), cwd=tmp_path)
    run = tmp_path / "run"
    assert json.loads((run / "run_info.json").read_text())["num_processes"] == 2

    lines = read_jsonl(run / "metrics.jsonl")
    train = [m for m in lines if "actor/pg_loss" in m]
    val = [m for m in lines if "val/reward/mean" in m]
    assert [m["step"] for m in train] == [1, 2] and [m["step"] for m in val] == [1, 2]
    rank_key = f"rewards/{REWARDS}:rank_zero_only"
    for m in train:
        assert m[f"{rank_key}/applicable_frac"] == 0.5  # process 0's rows only
        assert m[f"{rank_key}/mean"] is not None  # process 0's mean, weighed by its rows
        kept = m["dynamic_sampling/kept_groups"]
        assert kept > 0 and kept % 2 == 0  # the same number of groups on both processes
        assert m["batch/responses"] == kept * 4
    # process 1 finds fewer groups with a spread: process 0 set some of its own aside
    assert all(m["dynamic_sampling/unused_groups"] > 0 for m in train)
    assert val[0]["val/reward/mean"] is not None
    # each key says how processes combine it
    schema = json.loads((run / "metrics_schema.json").read_text())
    assert schema["actor/pg_loss"] == "sum" and schema["dynamic_sampling/kept_groups"] == "sum"
    assert schema[rank_key] == schema["reward"] == "moments" and schema["actor/clipfrac"] == "mean"
    assert schema["timing/step_s"] == "max" and schema["val/reward"] == "moments"

    rollouts = read_jsonl(run / "rollouts.jsonl")
    for m in train:  # every process's rows, not only the main one's
        assert sum(r["step"] == m["step"] for r in rollouts) == m["batch/responses"]

    # the vision tower trained: text-only micro-batches did not stop DDP
    before = load_file(str(vlm["model"] / "model.safetensors"))
    after = load_file(str(run / "checkpoints" / "global_step_2" / "model" / "model.safetensors"))
    vision = [k for k in before if k.startswith("visual.") or ".visual." in k]
    assert vision and any(not torch.equal(before[k], after[k]) for k in vision)


NOISY_REWARD = '''
import random

import numpy as np


def noisy_length(prompts, completions, **kwargs):
    return [(len(c) % 4) / 3 + 0.05 * random.random() + 0.05 * float(np.random.rand()) for c in completions]
'''


def test_fsdp_two_processes_train_save_and_resume_exactly(tmp_path):
    """FSDP2, bf16 compute over fp32 masters, dropout and noisy rewards: resuming at step 2 reaches step 4's weights."""
    from grouprl.models.tiny import build_tiny_text_lm

    words = ["yes", "no", "maybe", "left", "right"]
    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(4) for w in words]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + words, seed=0, attention_dropout=0.2)
    (tmp_path / "noisy.py").write_text(NOISY_REWARD)
    config = {
        "data": {"train_files": ["train.jsonl"], "max_response_length": 5, "rollout_batch_size": 4},
        "worker": {"actor": {"model": {"model_path": "model", "dtype": "bfloat16"}, "strategy": "fsdp",
                             "optim": {"lr": 1e-3}, "global_batch_size": 2,
                             "micro_batch_size_per_device_for_update": 2},
                   "rollout": {"n": 2}, "reward": {"functions": [{"name": "noisy.py:noisy_length"}]}},
        "trainer": {"max_steps": 4, "save_freq": 2, "logger": ["jsonl"], "device": "cpu"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", "config.yaml", "trainer.output_dir=full", cwd=tmp_path)
    torchrun("-m", "grouprl", "train", "config.yaml", "trainer.output_dir=resumed",
             "trainer.resume=full/checkpoints/global_step_2", cwd=tmp_path)
    info = json.loads((tmp_path / "full" / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["strategy"] == "fsdp" and info["rollout_weights"] == "copy"
    assert "trained weights and optimizer state fp32, compute bf16" in info["precision"]

    def weights(run: str, step: int) -> dict[str, torch.Tensor]:
        return load_file(str(tmp_path / run / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors"))

    full, resumed, middle = weights("full", 4), weights("resumed", 4), weights("full", 2)
    assert all(v.dtype == torch.float32 for v in full.values())  # the fp32 masters are what is saved
    assert any(not torch.equal(full[k], middle[k]) for k in full)  # steps 3 and 4 trained
    for key in full:
        assert torch.equal(resumed[key], full[key]), key
    assert [m["step"] for m in read_jsonl(tmp_path / "resumed" / "metrics.jsonl")] == [3, 4]


@pytest.mark.parametrize("async_mode", ["sync", "one_step_off"])
def test_flow_grpo_on_two_processes(tmp_path, async_mode):
    """Flow-GRPO-Fast under DDP: each process its own prompts, the global std over both, one set of weights."""
    pytest.importorskip("diffusers")
    from grouprl.domains.diffusion.objectives import group_advantages
    from grouprl.domains.diffusion.tiny import build_tiny_pixel_flow

    model = build_tiny_pixel_flow(tmp_path / "model", image_size=8, num_layers=1, num_attention_heads=2,
                                  attention_head_dim=8, embed_dim=16)
    words = ["a red square on the left", "a blue square on the right", "two green squares on the left",
             "a red circle on the right"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in words))
    config = {
        "kind": "flow",
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "rollout_batch_size": 2, "shuffle": False},
        "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04, "clip_range": 1e-2, "global_std": True},
        "worker": {"actor": {"model": {"model_path": str(model), "lora": {"rank": 4, "alpha": 8}},
                             "optim": {"lr": 1e-2}, "micro_batch_size": 4},
                   "rollout": {"n": 4, "num_steps": 4, "height": 8, "width": 8, "micro_batch_size": 4,
                               "sde_window_size": 2, "sde_window_range": [0, 4]},
                   "reward": {"functions": [{"name": "image_brightness"}]}},
        "trainer": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "logger": ["jsonl"], "device": "cpu",
                    "save_freq": 2, "async_mode": async_mode},
    }
    (tmp_path / "flow.yaml").write_text(yaml.safe_dump(config))
    torchrun("-m", "grouprl", "train", str(tmp_path / "flow.yaml"), cwd=tmp_path)
    run = tmp_path / "run"
    assert json.loads((run / "run_info.json").read_text())["num_processes"] == 2

    train = [m for m in read_jsonl(run / "metrics.jsonl") if "reward/mean" in m]
    assert [m["step"] for m in train] == [1, 2] and all(m["actor/grad_norm"] > 0 for m in train)
    if async_mode == "one_step_off":
        assert [m["async/staleness_steps"] for m in train] == [0.0, 1.0]
    rollouts = read_jsonl(run / "rollouts.jsonl")
    for step in (1, 2):
        rows = [r for r in rollouts if r["step"] == step]
        # both processes' rows, one prompt each (rollout_batch_size 2 over 2 processes)
        assert len(rows) == 8 and len({r["prompt"] for r in rows}) == 2
        # the std of global_std is that of both processes' rewards, not of each process's own
        whole = group_advantages(torch.tensor([r["score"] for r in rows]), 4, global_std=True, clip=5.0)
        assert [r["advantage"] for r in rows] == pytest.approx(whole.tolist(), abs=1e-5)
    assert (run / "checkpoints" / "global_step_2" / "model" / "adapter_model.safetensors").exists()
