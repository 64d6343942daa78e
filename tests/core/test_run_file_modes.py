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
    old = os.umask(0o022)
    try:
        build_tiny_text_lm(tmp_path / "model", [r["problem"] for r in records] + WORDS, seed=0)
    finally:
        os.umask(old)
    assert not wrong_modes(tmp_path / "model", 0o022)
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
    assert not wrong_modes(run, 0o022)


def wrong_modes(root, umask: int) -> list[str]:
    """Every file and directory under ``root`` whose mode is not 0666 / 0777 less ``umask``, with its mode."""
    wrong = []
    for path in [root, *root.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        if stat.S_IMODE(path.stat().st_mode) != want:
            wrong.append(f"{path.relative_to(root)}: {oct(stat.S_IMODE(path.stat().st_mode))}, not {oct(want)}")
    return wrong


def test_the_tiny_model_builders_follow_the_umask(tmp_path):
    """A stricter umask (027) too: the modes come from the umask, not from a fixed 0644 (the flow
    builder's test: tests/diffusion/test_flow_file_modes.py)."""
    from grouprl.models.tiny import build_tiny_vlm

    old = os.umask(0o027)
    try:
        built = [build_tiny_text_lm(tmp_path / "lm", ["say yes no"], seed=0),
                 build_tiny_vlm(tmp_path / "vlm", ["a red square"], seed=0)]
    finally:
        os.umask(old)
    for root in built:
        assert not wrong_modes(root, 0o027)
