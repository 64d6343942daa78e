"""`grouprl demo --flow` stopped by Ctrl-C during its RL run exits 130 with its checkpoint named, and the
same command run again resumes that run (the seeded pretraining is run again: the model the run started
from). The demo runs in a process of its own at sizes far below --quick's; the SIGINT is real, sent by
the process to itself when step 2 starts (that step finishes and is saved)."""

from __future__ import annotations

import json

TINY = dict(pretrain_steps=10, pretrain_batch=4, pairs=16, grpo_steps=3, prompts_per_step=2, n=2, held_out=2)

DRIVER = f"""
import os, signal, sys
import grouprl.domains.diffusion.demo as demo
from grouprl.cli import main
from grouprl.domains.diffusion.trainer import FlowGRPOTrainer

demo.QUICK = {TINY!r}
step = FlowGRPOTrainer.step

def interrupted_step(self, current):
    if os.environ.get("INTERRUPT") and current == 2:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self, current)

FlowGRPOTrainer.step = interrupted_step
sys.exit(main(["demo", "--flow", "--quick", "--out", sys.argv[1]]))
"""


def test_ctrl_c_in_the_flow_demo_saves_and_the_same_command_resumes(tmp_path, demo_process):
    out = tmp_path / "flow"
    stopped = demo_process(DRIVER, out, interrupt="1")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    checkpoint = (out / "flow_grpo_fast" / "checkpoints" / "global_step_2").resolve()
    assert [line for line in stopped.stdout.splitlines() if line.startswith("grouprl:")] == [
        f"grouprl: stopped by SIGINT after step 2: checkpoint {checkpoint} (run the same grouprl demo command again "
        "to resume)"]

    resumed = demo_process(DRIVER, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'flow_grpo_fast' / 'checkpoints' / 'global_step_2'} at step 2" in resumed.stdout
    lines = (out / "flow_grpo_fast" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
