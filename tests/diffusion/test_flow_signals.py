"""The flow trainer stops on SIGTERM as the language trainer does (the behaviour lives in the
shared run loop): the step in progress finishes and is saved, one line names it, the exit
status is 143, and `trainer.resume=auto` continues from it with each step logged once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("diffusers")

from grouprl.trainer import checkpoint as ckpt  # noqa: E402

# an image reward that sends SIGTERM to its own process once metrics.jsonl holds step 1,
# i.e. while step 2 is scored (SIGNAL_METRICS names the file; unset, it only scores)
SIGNALLING_REWARD = '''
import json
import os
import signal
from pathlib import Path

_sent = []


def index_and_signal(images, prompts, **metadata):
    metrics = os.environ.get("SIGNAL_METRICS")
    if metrics and not _sent and Path(metrics).exists() and any(
            json.loads(line)["step"] >= 1 for line in Path(metrics).read_text().splitlines()):
        _sent.append(True)
        os.kill(os.getpid(), signal.SIGTERM)
    return [float(i % 3) for i in range(len(images))]
'''


def steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def train(config, *extra, cwd, env=None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SIGNAL_METRICS"}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "grouprl", "train", str(config), *extra], cwd=cwd, env=environ,
                          capture_output=True, text=True, timeout=600)


def test_flow_run_saves_on_sigterm_and_resumes(tiny_flow, tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                                                  ["a red square on the left", "a blue square on the right"]))
    (tmp_path / "signalling.py").write_text(SIGNALLING_REWARD)
    run = tmp_path / "run"
    values = {
        "kind": "flow",
        "data": {"train_files": [str(tmp_path / "train.jsonl")], "rollout_batch_size": 2, "seed": 3},
        "algorithm": {"name": "flow_grpo_fast", "kl_coef": 0.04, "clip_range": 1e-2},
        "worker": {
            "actor": {"model": {"model_path": str(tiny_flow), "lora": {"rank": 4, "alpha": 8}},
                      "optim": {"lr": 1e-2}, "micro_batch_size": 4, "num_minibatches": 1},
            "rollout": {"n": 4, "num_steps": 4, "height": 8, "width": 8, "micro_batch_size": 4,
                        "sde_window_size": 2, "sde_window_range": [0, 4]},
            "reward": {"functions": [{"name": f"{tmp_path / 'signalling.py'}:index_and_signal"}]},
        },
        "trainer": {"output_dir": str(run), "max_steps": 3, "logger": ["jsonl"], "device": "cpu", "seed": 5},
    }
    config = tmp_path / "flow.yaml"
    config.write_text(yaml.safe_dump(values))

    stopped = train(config, cwd=tmp_path, env={"SIGNAL_METRICS": str(run / "metrics.jsonl")})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert [step for step, _ in ckpt.step_dirs(run / "checkpoints")] == [2]
    saved = str((run / "checkpoints" / "global_step_2").resolve())
    (line,) = [line for line in stopped.stdout.splitlines() if "stopped by" in line]
    assert "SIGTERM" in line and saved in line
    assert steps(run / "metrics.jsonl") == [1, 2]

    resumed = train(config, "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert steps(run / "metrics.jsonl") == [1, 2, 3]
    assert steps(run / "rollouts.jsonl") == [s for s in (1, 2, 3) for _ in range(2 * 4)]
