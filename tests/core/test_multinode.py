"""Two nodes on one machine: two torchrun node launchers (``--nnodes 2 --nproc_per_node 1``) meeting
through a c10d rendezvous on localhost, one process each, gloo on the CPU.

Each launcher is a subprocess in a session of its own, as a node's launcher is its own machine's:
a signal to one reaches that node's worker only, and the test can end each whole tree. The tests
check the world size and the nodes the run really had (run_info.json's ``processes``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

HERE = Path(__file__).parent
SIGNALLING_REWARD = HERE / "distributed" / "signalling_reward.py"
HANG_REWARDS = HERE / "distributed" / "hang_rewards.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def two_nodes(*args: str, cwd: Path, env: dict | None = None) -> Iterator[list[subprocess.Popen]]:
    """``torchrun --nnodes 2 --nproc_per_node 1 --node_rank N ... -m grouprl *args`` for N = 0 and 1, started
    at once; yields both launchers and, leaving, kills whatever of them still runs. The c10d rendezvous
    numbers the nodes itself (``--node_rank`` is for the static one), so which launcher becomes node 0
    is the rendezvous' choice: the tests tell the nodes apart by what their launchers printed."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SIGNAL_PLAN")}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    port, run_id = free_port(), uuid.uuid4().hex[:12]
    launchers = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                   "--node_rank", str(node), "--rdzv_backend", "c10d", "--rdzv_endpoint", f"localhost:{port}",
                   "--rdzv_id", run_id, "-m", "grouprl", *args]
            launchers.append(subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True, start_new_session=True))
        yield launchers
    finally:
        for proc in launchers:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def finish(proc: subprocess.Popen, timeout: int = 300) -> subprocess.CompletedProcess:
    """The launcher's completed process, once it has exited (a generous bound: the job must end by itself)."""
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def first_to_exit(launchers: list[subprocess.Popen], timeout: int = 300) -> subprocess.Popen:
    """The launcher that exits first (waiting at most ``timeout`` seconds in all)."""
    for _ in range(timeout * 2):
        for proc in launchers:
            try:
                proc.wait(timeout=0.25)
                return proc
            except subprocess.TimeoutExpired:
                pass
    raise AssertionError(f"no node launcher exited within {timeout} s")


def run_two_nodes(*args: str, cwd: Path, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Both launchers run to their end; their completed processes, in the order they were started."""
    with two_nodes(*args, cwd=cwd, env=env) as launchers:
        return [finish(proc) for proc in launchers]


def output(done: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- launcher {n}:\n{p.stdout[-3000:]}{p.stderr[-5000:]}" for n, p in enumerate(done))


def assert_two_nodes(run: Path) -> None:
    info = json.loads((run / "run_info.json").read_text())
    assert info["num_processes"] == 2 and info["num_nodes"] == 2, info
    assert [(p["rank"], p["node"], p["local_rank"], p["num_nodes"]) for p in info["processes"]] == \
        [(0, 0, 0, 2), (1, 1, 0, 2)], info
    assert all(p["host"] == socket.gethostname() for p in info["processes"])


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"global_step_{step}" / "model" / "model.safetensors"))


def test_a_process_names_its_node_from_the_launchers_environment(monkeypatch):
    from grouprl.trainer.parallel import node_label, this_process

    for name in ("GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    alone = this_process()
    assert alone == {"rank": 0, "local_rank": None, "node": None, "num_nodes": None, "host": socket.gethostname()}
    assert node_label(alone) == f"host {socket.gethostname()}"  # no launcher: the host alone
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "3")
    launched = this_process(11)
    assert (launched["rank"], launched["local_rank"], launched["node"], launched["num_nodes"]) == (11, 3, 1, 2)
    assert node_label(launched) == f"node 1 of 2, host {socket.gethostname()}"


def test_two_node_launchers_train_stop_on_sigterm_to_one_and_resume_exactly(say_task, tmp_path):
    """Node 1's launcher gets SIGTERM while step 2 is scored: torchrun forwards it to its worker, the
    stop is agreed with node 0's worker at the step boundary, both save step 2 and both launchers
    exit. Resumed on both nodes, step 3's weights are those of a run that was never stopped."""
    task = say_task(2)
    values = task.config(tmp_path / "run", [{"name": f"{SIGNALLING_REWARD}:length_and_signals"}], **{
        "worker.rollout.n": 2, "worker.actor.global_batch_size": 2, "trainer.max_steps": 3,
        "trainer.save_freq": -1, "trainer.logger": ["jsonl"], "trainer.device": "cpu"})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(values))

    full = run_two_nodes("train", "config.yaml", "trainer.output_dir=full", "trainer.save_freq=2", cwd=tmp_path)
    assert [p.returncode for p in full] == [0, 0], output(full)
    assert_two_nodes(tmp_path / "full")

    # the reward of rank 1 (node 1) signals its parent, node 1's launcher, once step 1 is logged
    plan = {"metrics": str(tmp_path / "stopped" / "metrics.jsonl"), "after_step": 1,
            "signals": [int(signal.SIGTERM)], "rank": 1, "target": "parent"}
    stopped = run_two_nodes("train", "config.yaml", "trainer.output_dir=stopped", cwd=tmp_path,
                            env={"SIGNAL_PLAN": json.dumps(plan)})
    text = output(stopped)
    assert all(p.returncode != 0 for p in stopped), text  # torchrun's own status for a worker that ended so
    # one launcher got the signal and passed it to its worker; the other node's worker learnt it at the
    # step boundary, and, being rank 0, named the checkpoint both saved
    (signalled,) = [p for p in stopped if "SIGTERM received" in p.stderr]
    (other,) = [p for p in stopped if p is not signalled]
    assert "SIGTERM received" not in other.stderr and "stopped by SIGTERM after step 2" in other.stdout, text
    run = tmp_path / "stopped"
    assert sorted(p.name for p in (run / "checkpoints").glob("global_step_*")) == ["global_step_2"], text
    assert_two_nodes(run)
    from grouprl.trainer import checkpoint as ckpt

    assert len(ckpt.load_state_dict(run / "checkpoints" / "global_step_2", "rng")["processes"]) == 2

    resumed = run_two_nodes("train", "config.yaml", "trainer.output_dir=stopped", "trainer.resume=auto", cwd=tmp_path)
    assert [p.returncode for p in resumed] == [0, 0], output(resumed)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    middle, uninterrupted, after_resume = weights(tmp_path / "full", 2), weights(tmp_path / "full", 3), weights(run, 3)
    assert any(not torch.equal(uninterrupted[k], middle[k]) for k in uninterrupted)  # step 3 trained
    assert all(torch.equal(weights(run, 2)[k], middle[k]) for k in middle)  # the stop saved step 2 as it was
    for key in uninterrupted:
        assert torch.equal(after_resume[key], uninterrupted[key]), key


def test_a_frozen_node_ends_the_job_naming_the_node(say_task, tmp_path):
    """Node 1's worker stops itself (SIGSTOP) in its reward: node 0's worker fails in the update's
    collective after trainer.distributed_timeout, naming its own node and the frozen one's."""
    task = say_task(4)
    pid_file = tmp_path / "frozen.pid"
    config = task.config(tmp_path / "run", [{"name": f"{HANG_REWARDS}:freeze_rank_one",
                                             "kwargs": {"pid_file": str(pid_file)}}], **{
        "data.rollout_batch_size": 2, "worker.rollout.n": 2, "worker.actor.global_batch_size": 2,
        "trainer.max_steps": 1, "trainer.device": "cpu", "trainer.logger": ["jsonl"],
        "trainer.distributed_timeout": 10})
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with two_nodes("train", "config.yaml", cwd=tmp_path) as launchers:
        try:
            first = first_to_exit(launchers)  # node 0's: its worker's collective fails
            done = [finish(first)]
        finally:
            # node 1's launcher waits on its frozen worker (on a cluster the scheduler ends the job when a
            # node fails: srun --kill-on-bad-exit, a PyTorchJob's failed replica): end that worker, and with it
            # the launcher
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        done += [finish(p) for p in launchers if p is not first]
    text = output(done)
    assert pid_file.exists(), text  # node 1's worker did freeze
    assert done[0].returncode != 0, text
    host = socket.gethostname()
    assert (f"CollectiveFailure: rank 0 of 2 (node 0 of 2, host {host}): a collective failed at step 1, "
            "train > update") in done[0].stderr, text
    assert "trainer.distributed_timeout=10 s" in done[0].stderr, text
    assert f"rank 1 (node 1 of 2, host {host}) was last at step 1, train > reward" in done[0].stderr, text


# ---------------------------------------------------------------------------- the examples

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _expand(word: str, values: dict[str, str]) -> str:
    """``word`` with its ``$NAME`` / ``${NAME}`` (shell) and ``$(NAME)`` (Kubernetes) references to
    ``values``; a reference to anything else fails the test, naming it."""
    import re

    def value(match: re.Match) -> str:
        name = next(g for g in match.groups() if g)
        assert name in values, f"{word!r} refers to ${name}, which the test does not know"
        return values[name]

    return re.sub(r"\$\(([A-Z_]+)\)|\$\{([A-Z_]+)\}|\$([A-Z_]+)", value, word)


def check_launch(words: list[str]) -> tuple:
    """``torchrun [its options] -m grouprl [grouprl's arguments]`` parsed by torchrun's own parser and by
    grouprl's (the config it names loads, with its overrides): (torchrun's args, grouprl's args)."""
    from torch.distributed.run import get_args_parser

    from grouprl.cli import build_parser
    from grouprl.config import load_config

    assert words[0] == "torchrun", words
    launch = get_args_parser().parse_args(words[1:])
    assert launch.module and launch.training_script == "grouprl", words
    args = build_parser().parse_args(launch.training_script_args)
    assert args.command == "train", words
    config = Path(args.config)
    assert not config.is_absolute() and (EXAMPLES.parent / config).is_file(), f"{config} is not in examples/"
    assert config.parent.name == "examples"
    load_config(EXAMPLES.parent / config, list(args.overrides))
    return launch, args


def test_the_slurm_example_launches_grouprl_on_two_nodes():
    import shlex

    text = (EXAMPLES / "slurm_multinode.sbatch").read_text()
    directives = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                      if line.startswith("#SBATCH --"))
    assert directives["nodes"] == "2" and directives["ntasks-per-node"] == "1", directives  # a launcher per node
    assert directives["gpus-per-node"] == "8" and directives["signal"].startswith("TERM@"), directives
    # the srun line and its continuations, in the shell's words
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    command = ""
    for line in lines[start:]:
        command += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            break
    words = shlex.split(command)
    srun = words[:words.index("torchrun")]
    assert "--kill-on-bad-exit=1" in srun, srun
    # what Slurm and the script's exports give each task; RDZV_ENDPOINT is the job's first node
    assert 'RDZV_ENDPOINT="$head_node:' in text and "scontrol show hostnames" in text
    values = {"SLURM_JOB_NUM_NODES": "2", "RDZV_ENDPOINT": "node-a:29512", "SLURM_JOB_ID": "12"}
    launch, args = check_launch([_expand(w, values) for w in words[len(srun):]])
    assert launch.nnodes == "2" and launch.nproc_per_node == "8", launch
    assert launch.rdzv_backend == "c10d" and launch.rdzv_endpoint == "node-a:29512", launch
    assert args.config == "examples/chexpo_v2.yaml" and "trainer.resume=auto" in args.overrides


def test_the_pytorchjob_example_launches_grouprl_on_two_nodes():
    manifest = yaml.safe_load((EXAMPLES / "pytorchjob_multinode.yaml").read_text())
    assert manifest["apiVersion"] == "kubeflow.org/v1" and manifest["kind"] == "PyTorchJob"
    assert manifest["metadata"]["name"]
    replicas = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"}
    assert sum(r["replicas"] for r in replicas.values()) == 2
    for role, replica in replicas.items():
        (container,) = [c for c in replica["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        assert container["image"], role
        assert container["workingDir"] == "/workspace", role  # the image holds the repository's examples/ there
        assert {"name": "pytorchjob-port", "containerPort": 23456} in container["ports"], role
        # the operator sets MASTER_ADDR (the Master's service) and MASTER_PORT in every replica
        values = {"MASTER_ADDR": "grouprl-chexpo-master-0", "MASTER_PORT": "23456"}
        launch, args = check_launch([_expand(w, values) for w in container["command"] + container.get("args", [])])
        assert launch.nnodes == "2", role  # the replicas: one node launcher each
        assert int(launch.nproc_per_node) == container["resources"]["limits"]["nvidia.com/gpu"], role
        assert launch.rdzv_backend == "c10d" and launch.rdzv_endpoint == "grouprl-chexpo-master-0:23456", role
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        output = next(o.split("=", 1)[1] for o in args.overrides if o.startswith("trainer.output_dir="))
        assert any(output.startswith(m + "/") for m in mounts), (role, output)  # on the shared volume
