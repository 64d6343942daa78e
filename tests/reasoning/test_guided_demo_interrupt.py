"""`grouprl demo --guided` stopped by Ctrl-C during its first RL run (Guided-GRPO) exits 130 with its
checkpoint named, and the same command run again reuses the SFT model and resumes that run, then
trains GRPO. The demo runs in a process of its own at sizes far below --quick's; the SIGINT is real,
sent by the process to itself when Guided-GRPO's step 2 starts (that step finishes and is saved)."""

from __future__ import annotations

import json

TINY = dict(train=32, corrections=8, val=8, max_value=10, sft_epochs=1, grpo_steps=3, n=2, prompts_per_step=2)

DRIVER = f"""
import os, signal, sys
import grouprl.domains.reasoning.demo as demo
from grouprl.cli import main
from grouprl.trainer.grpo import GRPOTrainer

demo.GUIDED_QUICK = {TINY!r}
step = GRPOTrainer.step

def interrupted_step(self, current):
    if os.environ.get("INTERRUPT") and current == 2 and self.config.worker.rollout.verifier.enable:
        os.kill(os.getpid(), signal.SIGINT)
    return step(self, current)

GRPOTrainer.step = interrupted_step
sys.exit(main(["demo", "--guided", "--quick", "--out", sys.argv[1]]))
"""


def test_ctrl_c_in_guided_grpo_saves_and_the_same_command_resumes(tmp_path, demo_process):
    out = tmp_path / "guided"
    stopped = demo_process(DRIVER, out, interrupt="1")
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    checkpoint = (out / "guided" / "checkpoints" / "global_step_2").resolve()
    assert [line for line in stopped.stdout.splitlines() if line.startswith("grouprl:")] == [
        f"grouprl: stopped by SIGINT after step 2: checkpoint {checkpoint} (run the same grouprl demo command again "
        "to resume)"]

    resumed = demo_process(DRIVER, out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"the SFT model of the earlier run is reused: {out / 'sft_model'}" in " ".join(resumed.stdout.split())
    assert f"resumed from {out / 'guided' / 'checkpoints' / 'global_step_2'} at step 2" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (out / "guided" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert (out / "summary.json").exists() and (out / "grpo" / "metrics.jsonl").exists()
