"""Ctrl-C during `grouprl demo` is one line and exit status 130, never a traceback, and the same
command run again continues: the stages that finished are reused, training resumes from the
checkpoint the signal saved.

The report demo runs in a process of its own at sizes far below --quick's (patched in before it
starts), and the SIGINT is real: the process sends it to itself when SFT starts, or when GRPO
step 2 starts (that step finishes and is the checkpoint), so the moment is known without timing.
"""

from __future__ import annotations

import json

TINY = dict(train=16, val=4, sft_epochs=1, sft_batch=8, grpo_steps=3, n=2, prompts_per_step=4)

DRIVER = f"""
import os, signal, sys
import grouprl.domains.radiology.demo as demo
import grouprl.trainer.sft as sft
from grouprl.cli import main
from grouprl.trainer.grpo import GRPOTrainer

demo.QUICK = {TINY!r}
where = os.environ.get("INTERRUPT")
run_sft, step = sft.run_sft, GRPOTrainer.step

def interrupted_sft(*args, **kwargs):
    if where == "sft":
        os.kill(os.getpid(), signal.SIGINT)
    return run_sft(*args, **kwargs)

def interrupted_step(self, current):
    if where == "grpo" and current == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self, current)

sft.run_sft, GRPOTrainer.step = interrupted_sft, interrupted_step
sys.exit(main(["demo", "--quick", "--out", sys.argv[1]]))
"""


def grouprl_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("grouprl:")]


def test_ctrl_c_in_sft_is_one_line_and_130_then_the_demo_runs_from_the_start(tmp_path, demo_process):
    out = tmp_path / "demo"
    stopped = demo_process(DRIVER, out, "sft")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stderr
    assert grouprl_lines(stopped.stderr) == [
        "grouprl: demo interrupted (SIGINT); the stages that finished are kept: run the same grouprl demo command "
        "again to resume"]
    assert stopped.stderr.strip().splitlines()[-1] == grouprl_lines(stopped.stderr)[0]
    assert not (out / "sft_model").exists() and not (out / "grpo").exists()


def test_ctrl_c_in_training_saves_and_the_same_command_resumes(tmp_path, demo_process):
    out = tmp_path / "demo"
    stopped = demo_process(DRIVER, out, "grpo")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    checkpoint = (out / "grpo" / "checkpoints" / "global_step_2").resolve()
    assert grouprl_lines(stopped.stdout) == [
        f"grouprl: stopped by SIGINT after step 2: checkpoint {checkpoint} (run the same grouprl demo command again "
        "to resume)"]
    assert not (out / "summary.json").exists()

    resumed = demo_process(DRIVER, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the SFT model of the earlier run is reused: {out / 'sft_model'}" in " ".join(resumed.stdout.split())
    assert f"resumed from {out / 'grpo' / 'checkpoints' / 'global_step_2'} at step 2" in resumed.stdout
    rows = [json.loads(line) for line in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3]  # each step once: 1 and 2 from the
    # stopped run, 3 after resuming; the validations before training and at the last step, once each
    assert [r["step"] for r in rows if "val/reward/mean" in r] == [0, 3]
    assert json.loads((out / "summary.json").read_text())["sizes"] == TINY
