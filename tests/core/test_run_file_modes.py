"""Run files are readable by whoever the umask lets read them (a team on a shared cluster), not 0600."""

from __future__ import annotations

import json
import os
import stat

import yaml

from grouprl.cli import main
from grouprl.models.tiny import build_tiny_text_lm

WORDS = ["yes", "no"]


def test_every_file_of_a_run_its_checkpoint_and_an_export_follows_the_umask(tmp_path):
    records = [{"problem": f"Say {w} {i}", "answer": w} for i in range(2) for w in WORDS]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + WORDS, seed=0)
    run = tmp_path / "run"
    config = {
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "max_response_length": 3, "rollout_batch_size": 2},
        "worker": {"actor": {"model": {"model_path": str(tmp_path / "model")}, "global_batch_size": 2,
                             "micro_batch_size_per_device_for_update": 4},
                   "rollout": {"n": 2}, "reward": {"functions": [{"name": "accuracy"}]}},
        "trainer": {"max_steps": 1, "logger": ["jsonl"], "device": "cpu", "output_dir": str(run), "save_freq": 1},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    old = os.umask(0o022)
    try:
        assert main(["train", str(tmp_path / "config.yaml")]) == 0
        assert main(["export", str(run / "checkpoints" / "global_step_1"), "--out", str(run / "exported")]) == 0
    finally:
        os.umask(old)
    files = [p for p in run.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "run_info.json", "manifest.json"} <= names and any(n.endswith(".safetensors") for n in names)
    assert list((run / "exported").glob("*.safetensors"))
    private = [str(p.relative_to(run)) for p in files if stat.S_IMODE(p.stat().st_mode) & 0o044 != 0o044]
    assert not private, f"files not readable by group and others under umask 022: {private}"
    dirs = [p for p in run.rglob("*") if p.is_dir()]
    assert all(stat.S_IMODE(d.stat().st_mode) & 0o055 == 0o055 for d in dirs)
