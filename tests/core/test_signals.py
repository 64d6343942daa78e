"""A run stopped by SIGTERM or SIGINT saves its last finished step, names it and resumes from it;
a killed run, checkpointed or not, logs each step once after resuming.

The signals come from the run itself: a reward sends them once step ``after_step`` is in
metrics.jsonl, i.e. while the next step is being scored. That makes the step in progress
known without timing: it finishes, and its checkpoint is the one the stop saves.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from grouprl.config import config_from_dict
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.grpo import GRPOTrainer
from grouprl.trainer.signals import TrainingStopped

HERE = Path(__file__).parent
SIGNALLING_REWARD = HERE / "distributed" / "signalling_reward.py"
ROWS_PER_STEP = 4 * 2  # rollout_batch_size x worker.rollout.n


@pytest.fixture(scope="module")
def task(say_task):
    return say_task(2)


def write_config(task, run: Path, path: Path, **overrides) -> Path:
    values = task.config(run, [{"name": f"{SIGNALLING_REWARD}:length_and_signals"}], **{
        "worker.rollout.n": 2, "worker.actor.global_batch_size": 2, "trainer.max_steps": 3, "trainer.save_freq": -1, "trainer.log_completions": True,
        **overrides})
    path.write_text(yaml.safe_dump(values))
    return path


def plan(run: Path, after_step: int, signals: list[int], **extra) -> dict[str, str]:
    """The environment that makes the reward send ``signals`` once ``after_step`` is logged."""
    return {"SIGNAL_PLAN": json.dumps({"metrics": str(run / "metrics.jsonl"), "after_step": after_step,
                                       "signals": signals, **extra})}


def default_sigint() -> None:
    """In the child before it starts: SIGINT back to its default. A command started in the background
    by a shell (``cmd &``) inherits SIGINT ignored, and Python then leaves it ignored, as the
    convention for background jobs wants; these tests are about what grouprl does when it arrives."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def grouprl(*args: str, cwd: Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "SIGNAL_PLAN"}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "grouprl", *args], cwd=cwd, env=environ, capture_output=True,
                          text=True, timeout=timeout, preexec_fn=default_sigint)


def torchrun(*args: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "SIGNAL_PLAN")}
    environ.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "grouprl", *args]
    with subprocess.Popen(cmd, cwd=cwd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, preexec_fn=default_sigint) as proc:
        try:
            out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            # e.g. processes that disagree about stopping, stuck in different collectives: torchrun
            # on SIGTERM ends its workers (they run in sessions of their own, a kill would orphan them)
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
            pytest.fail(f"torchrun did not finish in 600 s:\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def checkpoints(run: Path) -> list[int]:
    return [step for step, _ in ckpt.step_dirs(run / "checkpoints")] if (run / "checkpoints").exists() else []


def assert_each_step_once(run: Path, last: int, *, val: bool = False) -> None:
    every = list(range(1, last + 1))
    assert steps(run / "metrics.jsonl") == (sorted(every + [0] + every) if val else every)
    for name in ("rollouts.jsonl", "completions.jsonl"):
        assert steps(run / name) == [s for s in every for _ in range(ROWS_PER_STEP)], name


def stop_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if "stopped by" in line]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_the_step_in_progress_and_the_run_resumes_from_it(task, tmp_path, signum):
    run = tmp_path / "run"
    config = write_config(task, run, tmp_path / "config.yaml")
    stopped = grouprl("train", str(config), cwd=tmp_path, env=plan(run, 1, [int(signum)]))
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr
    # the signal came while step 2 was scored: step 2 finished and is the checkpoint
    assert checkpoints(run) == [2]
    (line,) = stop_lines(stopped)
    assert str((run / "checkpoints" / "global_step_2").resolve()) in line and signum.name in line
    assert_each_step_once(run, 2)

    resumed = grouprl("train", str(config), "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "global_step_2 at step 2" in resumed.stdout
    assert checkpoints(run) == [2, 3]
    assert_each_step_once(run, 3)


def test_a_second_signal_exits_at_once_without_saving(task, tmp_path):
    """The second SIGTERM comes (past the window in which a repeat counts as the same request)
    while step 2 is still being scored: nothing is saved, step 2 is not logged."""
    run = tmp_path / "run"
    config = write_config(task, run, tmp_path / "config.yaml")
    stopped = grouprl("train", str(config), cwd=tmp_path,
                      env=plan(run, 1, [int(signal.SIGTERM), int(signal.SIGTERM)], pause_s=3.0))
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "SIGTERM again: exiting now without saving" in stopped.stderr
    assert checkpoints(run) == [] and not stop_lines(stopped)
    assert steps(run / "metrics.jsonl") == [1]


def test_without_save_on_signal_sigint_stops_with_one_line_and_no_checkpoint(task, tmp_path):
    run = tmp_path / "run"
    config = write_config(task, run, tmp_path / "config.yaml", **{"trainer.save_on_signal": False})
    stopped = grouprl("train", str(config), cwd=tmp_path, env=plan(run, 1, [int(signal.SIGINT)]))
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "interrupted" in stopped.stderr
    assert checkpoints(run) == []


def test_kill_before_the_first_checkpoint_then_resume_logs_each_step_once(task, tmp_path):
    """SIGKILL while step 3 is scored (no checkpoint yet): resume=auto starts afresh and rewrites
    every log, validation's and TensorBoard's included, instead of appending to the killed run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    config = write_config(task, run, tmp_path / "config.yaml", **{
        "trainer.max_steps": 4, "trainer.logger": ["jsonl", "tensorboard"], "trainer.val_before_train": True,
        "trainer.val_freq": 1, "data.val_files": [str(task.data)]})
    killed = grouprl("train", str(config), cwd=tmp_path, env=plan(run, 2, [int(signal.SIGKILL)]))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert checkpoints(run) == []
    assert 2 in steps(run / "metrics.jsonl")  # the killed run logged steps: they must not show twice

    resumed = grouprl("train", str(config), "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_each_step_once(run, 4, val=True)
    val_steps = sorted(set(steps(run / "val_generations.jsonl")))
    assert val_steps == [0, 1, 2, 3, 4]
    per_step = [steps(run / "val_generations.jsonl").count(s) for s in val_steps]
    assert len(set(per_step)) == 1, per_step
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val/reward/mean")] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("target", ["one process", "torchrun"])
def test_two_processes_stop_together_on_a_signal_to_either(task, tmp_path, target):
    """Process 1 alone gets SIGTERM (process 0 learns it at the step boundary), or torchrun gets it
    and forwards it to both: both save step 2 together, and a run resumes from it."""
    run = tmp_path / "run"
    config = write_config(task, run, tmp_path / "config.yaml")
    extra = {"rank": 1} if target == "one process" else {"rank": 0, "target": "parent"}
    stopped = torchrun("train", str(config), cwd=tmp_path, env=plan(run, 1, [int(signal.SIGTERM)], **extra))
    assert json.loads((run / "run_info.json").read_text())["num_processes"] == 2
    assert stopped.returncode != 0  # torchrun's own: 1, as for any worker that fails
    if target == "one process":
        # torchrun names the workers' statuses: 143, or -15 for one it ended itself (SIGTERM) once its
        # peer had exited, after the save, while it was exiting too
        statuses = dict(re.findall(r"rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", stopped.stderr))
        assert "143" in statuses.values() and set(statuses.values()) <= {"143", "-15"}, stopped.stderr[-4000:]
    assert checkpoints(run) == [2], stopped.stderr[-4000:]
    (line,) = stop_lines(stopped)
    assert str((run / "checkpoints" / "global_step_2").resolve()) in line
    received = [line for line in stopped.stderr.splitlines() if "SIGTERM received" in line]
    assert len(received) == (1 if target == "one process" else 2), stopped.stderr[-4000:]
    # every process took part in the save: each one's RNG state is in it
    rng = ckpt.load_state_dict(run / "checkpoints" / "global_step_2", "rng")
    assert len(rng["processes"]) == 2
    assert_each_step_once(run, 2)

    resumed = grouprl("train", str(config), "trainer.resume=auto", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_each_step_once(run, 3)


def test_library_train_restores_the_signal_handlers(task, tmp_path, monkeypatch):
    """In process: a SIGINT during step 2 stops train() with TrainingStopped after saving step 2,
    and train() leaves the handlers it found, here and after a run that ends normally."""
    values = yaml.safe_load(write_config(task, tmp_path / "run", tmp_path / "config.yaml").read_text())
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainer = GRPOTrainer(config_from_dict(values))
    step = trainer.step

    def signalling(current):
        if current == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return step(current)

    monkeypatch.setattr(trainer, "step", signalling)
    with pytest.raises(TrainingStopped) as stopped:
        trainer.train()
    assert stopped.value.step == 2 and stopped.value.exit_status == 130
    assert stopped.value.checkpoint == (tmp_path / "run" / "checkpoints" / "global_step_2").resolve()
    assert {s: signal.getsignal(s) for s in before} == before

    values["trainer"]["resume"] = "auto"
    resumed = GRPOTrainer(config_from_dict(values))
    resumed.train()
    assert resumed.state.global_step == 3
    assert {s: signal.getsignal(s) for s in before} == before


# a reward that, from step 2 on, waits for the test to close the console's pipe and send the signal
WAITS_FOR_GO = '''
import os
import time
from pathlib import Path


def length_after_go(prompts, completions, **columns):
    metrics = Path(os.environ["RUN_METRICS"])
    if metrics.exists() and metrics.read_text().strip():  # step 1 is logged: this is step 2
        go = Path(os.environ["GO_FILE"])
        Path(f"{go}.waiting").touch()
        while not go.exists():
            time.sleep(0.05)
    return [len(c) / 10 for c in completions]
'''


@pytest.mark.parametrize("stderr", ["2>&1 | tee", "2>err | tee"])
def test_a_console_pipe_closed_mid_run_loses_nothing(task, tmp_path, stderr):
    """Ctrl-C on `grouprl train ... | tee` ends tee too: the run's console pipe closes while step 2 runs,
    then SIGINT comes. Every later write (the SIGINT notice, step 2's console line, the line naming the
    checkpoint, the flush at exit) finds no reader: the run still saves step 2 and exits 130, with no
    traceback and no "Exception ignored" where stderr still has a reader."""
    run = tmp_path / "run"
    (tmp_path / "rewards.py").write_text(WAITS_FOR_GO)
    values = task.config(run, [{"name": f"{tmp_path / 'rewards.py'}:length_after_go"}], **{
        "worker.rollout.n": 2, "worker.actor.global_batch_size": 2, "trainer.max_steps": 3, "trainer.save_freq": -1,
        "trainer.logger": ["jsonl", "console"]})
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(values))
    go = tmp_path / "go"
    environ = {k: v for k, v in os.environ.items() if k != "SIGNAL_PLAN"}
    environ.update(OMP_NUM_THREADS="1", RUN_METRICS=str(run / "metrics.jsonl"), GO_FILE=str(go))
    err_path = tmp_path / "err.txt"
    with open(err_path, "wb") as err_file:
        proc = subprocess.Popen([sys.executable, "-m", "grouprl", "train", str(config)], cwd=tmp_path, env=environ,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr == "2>&1 | tee" else err_file,
                                preexec_fn=default_sigint)
        try:
            if stderr == "2>&1 | tee":
                proc.stdout.read(1)  # the pipe is in use (the model's loading says so), then its reader goes
            while proc.poll() is None and not (tmp_path / "go.waiting").exists():  # step 2 is being scored
                time.sleep(0.1)
            proc.stdout.close()
            proc.send_signal(signal.SIGINT)
            go.touch()
            returncode = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = err_path.read_text()
    assert returncode == 130, err[-3000:]
    assert checkpoints(run) == [2]
    assert ckpt.verify_checkpoint(run / "checkpoints" / "global_step_2").intact
    assert steps(run / "metrics.jsonl") == [1, 2]
    if stderr == "2>err | tee":  # stderr kept its reader: the notice is there, and no error
        assert "SIGINT received" in err
        assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipeError" not in err
