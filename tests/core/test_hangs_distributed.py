"""A frozen process ends a two-process job (torchrun, gloo) within trainer.distributed_timeout, named.

Process 1 stops itself (SIGSTOP) in its reward; process 0 goes on to the update, whose
gradient all-reduce waits for it. With a short ``trainer.distributed_timeout`` the wait
fails, process 0 says where it was and where process 1 last was, and torchrun ends the job.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).parent
REWARDS = HERE / "distributed" / "hang_rewards.py"


def test_a_frozen_rank_ends_the_job_naming_the_rank_and_the_stages(say_task, tmp_path):
    task = say_task(4)
    pid_file = tmp_path / "frozen.pid"
    config = task.config(tmp_path / "run", [{"name": f"{REWARDS}:freeze_rank_one",
                                             "kwargs": {"pid_file": str(pid_file)}}], **{
        "data.rollout_batch_size": 2, "worker.rollout.n": 2, "worker.actor.global_batch_size": 2,
        "trainer.max_steps": 1, "trainer.device": "cpu", "trainer.logger": ["jsonl"],
        "trainer.distributed_timeout": 10})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "grouprl", "train", str(tmp_path / "config.yaml")]
    # a session of its own: whatever happens, the whole job can be killed at the end
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)  # a generous bound: the job must end by itself
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        if pid_file.exists():  # the frozen process, if torchrun left it behind
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
    assert pid_file.exists(), output[-4000:]  # process 1 did freeze
    assert proc.returncode != 0, output[-4000:]
    node = f"node 0 of 1, host {socket.gethostname()}"  # torchrun's one node (two nodes: test_multinode.py)
    assert f"CollectiveFailure: rank 0 of 2 ({node}): a collective failed at step 1, train > update" in output, \
        output[-4000:]
    assert "trainer.distributed_timeout=10 s" in output
    assert f"rank 1 ({node}) was last at step 1, train > reward" in output, output[-4000:]
