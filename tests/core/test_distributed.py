"""Two real processes on the CPU: `torchrun --nproc_per_node 2` with gloo.

(`accelerate launch --cpu --num_processes 2` starts one process, so it cannot test
this.) Each test checks the world size the processes really had.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

HERE = Path(__file__).parent
REWARDS = HERE / "distributed" / "rank_rewards.py"


def test_update_on_two_processes_matches_the_whole_batch_on_one(tmp_path, torchrun):
    """Same gradients as one process with the whole batch; pg_loss and kl_loss logged at their true value.

    With micro-batches of fixed rows, and with a token budget whose plans differ between the processes."""
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
        # the entropy bonus: the whole batch's gradient; the adaptive controller's entropy is the token mean
        # over both processes' rows, and it moved the coefficient by one delta
        r = result["entropy"]
        assert r["max_abs_grad"] > 1e-3 and r["max_abs_grad_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), r
        assert r["last_entropy"] == pytest.approx(r["whole_entropy"], rel=1e-6) and r["coef"] == 0.75, r

    # dynamic batching (token budget): the processes' rows differ in length, so alone they
    # would plan different numbers of micro-batches; they take the same number, within the
    # budget, and the gradients are still the whole batch's
    results = [json.loads((tmp_path / "out" / f"rank{rank}.json").read_text())["dynamic"] for rank in (0, 1)]
    local = [r["local_micro_batches"] for r in results]
    assert local == [4, 2], results  # rank 0: four rows of 11-12 tokens; rank 1: four of 6-7 tokens
    for rank, result in enumerate(results):
        assert set(result["modes"]) == {"token-mean", "seq-mean-token-mean"}
        for mode, r in result["modes"].items():
            assert r["micro_batches_taken"] == max(local), (rank, mode, r)
            assert r["micro_batches_logged"] == max(local), (rank, mode, r)
            assert all(tokens <= result["budget"] for tokens in r["micro_batch_tokens"]), (rank, mode, r)
            assert sum(r["micro_batch_tokens"]) == sum(result["token_counts"]), (rank, mode, r)  # every row once
            assert r["same_parameters"], mode
            assert r["max_abs_grad"] > 1e-3, mode
            assert r["max_abs_grad_diff"] <= 1e-6 * max(1.0, r["max_abs_grad"]), (rank, mode, r)
            assert r["pg_loss_logged"] == pytest.approx(r["pg_loss_whole"], rel=1e-5), mode
            assert r["kl_loss_logged"] == pytest.approx(r["kl_loss_whole"], rel=1e-5), mode


@pytest.fixture(scope="module")
def vlm(image_task, tmp_path_factory, read_jsonl):
    task = image_task(4, format="easyr1")
    root = tmp_path_factory.mktemp("vlm2")
    images = read_jsonl(task.data)
    for r in images:
        r["images"] = [str(task.data.parent / p) for p in r["images"]]
    texts = [{"id": f"text{i}", "problem": f"Describe a picture you cannot see, version {i}.",
              "answer": "A grey field."} for i in range(4)]
    # unshuffled, each process's shard of a step holds one picture with an image and one without
    mixed = [images[0], images[1], texts[0], texts[1], images[2], images[3], texts[2], texts[3]]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mixed))
    (root / "val.jsonl").write_text(json.dumps(images[0]) + "\n")  # one sample: process 1 validates none
    return {"root": root, "model": task.model}


def test_two_processes_train_a_vlm_with_a_trainable_vision_tower(vlm, tmp_path, torchrun, read_jsonl):
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


def test_fsdp_two_processes_train_save_and_resume_exactly(tmp_path, torchrun, read_jsonl):
    """FSDP2, bf16 compute over fp32 masters, dropout and noisy rewards: resuming at step 2 reaches step 4's weights.

    The forwards run packed (padding_free), in micro-batches by tokens, and through the output layer
    three tokens at a time under activation checkpointing: the paths FSDP's hooks must see."""
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
                             "micro_batch_size_per_device_for_update": 2, "padding_free": True,
                             "dynamic_batching": True, "log_prob_chunk_tokens": 3},
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
