"""Flow-GRPO on two real processes on the CPU: `torchrun --nproc_per_node 2` with gloo
(the language-model runs: tests/core/test_distributed.py)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("diffusers")


@pytest.mark.parametrize("async_mode", ["sync", "one_step_off"])
def test_flow_grpo_on_two_processes(tiny_flow, tmp_path, torchrun, read_jsonl, async_mode):
    """Flow-GRPO-Fast under DDP: each process its own prompts, the global std over both, one set of weights."""
    from grouprl.domains.diffusion.objectives import group_advantages

    words = ["a red square on the left", "a blue square on the right", "two green squares on the left",
             "a red circle on the right"]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in words))
    config = {
        "kind": "flow",
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "rollout_batch_size": 2, "shuffle": False},
        "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04, "clip_range": 1e-2, "global_std": True},
        "worker": {"actor": {"model": {"model_path": str(tiny_flow), "lora": {"rank": 4, "alpha": 8}},
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
