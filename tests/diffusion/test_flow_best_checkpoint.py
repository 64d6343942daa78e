"""The flow trainer keeps the best checkpoint and validates alone as the language trainer does (one run
loop, ``grouprl.trainer.loop``): `grouprl validate` on a flow config (``kind: flow``) reproduces the
run's validation, the moving average of the weights included."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from grouprl.cli import main  # noqa: E402
from grouprl.trainer import checkpoint as ckpt  # noqa: E402


def test_flow_run_keeps_best_and_validate_reproduces_it(tiny_flow, prompts, tmp_path, capsys):
    run = tmp_path / "run"
    values = {
        "kind": "flow",
        "data": {"train_files": [str(prompts / "train.jsonl")], "val_files": [str(prompts / "val.jsonl")],
                 "rollout_batch_size": 2, "seed": 3},
        "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04},
        "worker": {"actor": {"model": {"model_path": str(tiny_flow), "lora": {"rank": 2, "alpha": 4}},
                             "micro_batch_size": 4, "ema": {"enabled": True}},
                   "rollout": {"n": 2, "num_steps": 3, "height": 8, "width": 8, "micro_batch_size": 4,
                               "sde_window_size": 1, "sde_window_range": [0, 3], "val_num_steps": 3},
                   "reward": {"functions": [{"name": "image_brightness"}]}},
        "trainer": {"output_dir": str(run), "max_steps": 2, "logger": ["jsonl"], "device": "cpu", "seed": 5,
                    "val_freq": 1, "val_before_train": True, "best_metric": "val/reward/mean"},
    }
    (tmp_path / "config.yaml").write_text(json.dumps(values))
    assert main(["train", str(tmp_path / "config.yaml")]) == 0
    best = json.loads((run / "run_info.json").read_text())["best"]
    assert ckpt.verify_checkpoint(run / "checkpoints" / "best").intact
    assert ckpt.load_trainer_state(run / "checkpoints" / "best").global_step == best["step"]
    lines = {x["step"]: x for x in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if "val/reward/mean" in x}
    assert best["value"] == max(x["val/reward/mean"] for x in lines.values())
    capsys.readouterr()
    assert main(["validate", str(tmp_path / "config.yaml"), "--checkpoint", "best", "--out", str(tmp_path / "v")]) == 0
    written = json.loads((tmp_path / "v" / "validation.json").read_text())
    assert written["step"] == best["step"]
    for key, value in lines[best["step"]].items():
        if key.startswith("val/") and not key.startswith("val/timing/"):
            assert written["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert list((tmp_path / "v" / "val_images").glob("*.png"))  # the grid goes where --out says
