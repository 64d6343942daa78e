"""Crash safety of checkpoint saves, and logs that hold each step once after a resume."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.checkpoint import TrainerState, latest_checkpoint, load_state_dict, save_checkpoint, step_dirs
from grouprl.trainer.logging import MetricsLogger, RolloutWriter, truncate_jsonl

# ---------------------------------------------------------------------------- checkpoints


class VersionedModel:
    """Stands in for a model: its weights are filled with `version`, so a checkpoint tells which save wrote it."""

    def __init__(self, version: int):
        self.weight = torch.full((4, 4), float(version))

    def save_pretrained(self, path: Path, safe_serialization: bool = True) -> None:
        path.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight}, str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({"version": float(self.weight[0, 0])}))


def save_version(root: Path, step: int, version: int, **kwargs) -> Path:
    """A checkpoint of `step` whose every file (model, optimizer, trainer state) records `version`."""
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=float(version))
    state = TrainerState(global_step=step, extra={"version": version})
    return save_checkpoint(root, state, VersionedModel(version), optimizer, None, **kwargs)


def version_of(path: Path) -> int:
    """The version a checkpoint holds; fails if its files come from different saves or any is missing."""
    weights = load_file(str(path / "model" / "model.safetensors"))["weight"]
    config = json.loads((path / "model" / "config.json").read_text())
    lr = load_state_dict(path, "optimizer")["param_groups"][0]["lr"]
    state = ckpt.load_trainer_state(path)
    load_state_dict(path, "rng")
    version = state.extra["version"]
    assert torch.all(weights == version) and config["version"] == version and lr == version, path
    return version


class SimulatedCrash(Exception):
    pass


@contextmanager
def crash_at(monkeypatch, k: int):
    """Kill the process (raise) at the k-th rename, removal or fsync; yields a list of the calls counted.

    A killed ``rmtree`` leaves half its files behind, the first half in name order, which takes the
    model weights and leaves trainer_state.json: the worst case for a reader.
    """
    calls: list[str] = []
    real = {"replace": os.replace, "rename": os.rename, "fsync": os.fsync, "rmtree": shutil.rmtree}

    def counted(name):
        def op(*args, **kwargs):
            calls.append(name)
            if len(calls) == k:
                if name == "rmtree" and Path(args[0]).is_dir():
                    files = sorted(p for p in Path(args[0]).rglob("*") if p.is_file())
                    for p in files[: len(files) // 2]:
                        p.unlink()
                raise SimulatedCrash(f"killed at {name} #{k}")
            return real[name](*args, **kwargs)

        return op

    for name in ("replace", "rename", "fsync"):
        monkeypatch.setattr(os, name, counted(name))
    monkeypatch.setattr(shutil, "rmtree", counted("rmtree"))
    try:
        yield calls
    finally:
        monkeypatch.undo()


def test_resave_survives_a_crash_at_every_point(tmp_path, monkeypatch):
    """Re-saving step 2 and dying anywhere leaves step 2 complete: all old or all new, never missing."""
    outcomes = set()
    for k in range(1, 200):
        root = tmp_path / f"crash{k}" / "checkpoints"
        save_version(root, 1, version=1)
        save_version(root, 2, version=2)
        with crash_at(monkeypatch, k) as calls:
            try:
                save_version(root, 2, version=3, save_limit=1)
                crashed = False
            except SimulatedCrash:
                crashed = True
        latest = latest_checkpoint(root)
        assert latest == root / "global_step_2", (k, calls)
        got = version_of(latest)
        assert got in (2, 3), k
        # step 1, being pruned, is either still whole or gone
        assert [s for s, _ in step_dirs(root)] in ([1, 2], [2]), k
        if (root / "global_step_1").exists():
            assert version_of(root / "global_step_1") == 1, k
        assert not [p.name for p in root.iterdir() if p.name.startswith(".global_step_")], k
        outcomes.add(got)
        # the run goes on: saving again (the same step, then the next) works
        save_version(root, 2, version=4)
        assert version_of(latest_checkpoint(root)) == 4
        save_version(root, 3, version=5, save_limit=2)
        assert [s for s, _ in step_dirs(root)] == [2, 3] and version_of(latest_checkpoint(root)) == 5
        if not crashed:
            assert got == 3
            break
    else:
        pytest.fail("the save never ran to the end")
    assert k > 5 and outcomes == {2, 3}  # crashes hit both before and after the new copy took over


def test_crash_between_renames_is_recovered(tmp_path):
    """The states a kill between `global_step_N -> aside` and `tmp -> global_step_N` can leave."""
    root = tmp_path / "ck"
    save_version(root, 2, version=2)
    final, aside, tmp = root / "global_step_2", root / ".global_step_2.old", root / ".global_step_2.tmp"

    os.rename(final, aside)  # only the aside copy: it is restored
    assert latest_checkpoint(root) == final and version_of(final) == 2 and not aside.exists()

    shutil.copytree(final, tmp)  # a complete temp copy and nothing else: it is promoted
    shutil.rmtree(final)
    assert [s for s, _ in step_dirs(root)] == [2] and version_of(final) == 2 and not tmp.exists()

    shutil.copytree(final, tmp)  # an incomplete temp copy with no checkpoint left: nothing to use
    (tmp / "trainer_state.json").unlink()
    shutil.rmtree(final)
    assert latest_checkpoint(root) is None and not tmp.exists()


def test_save_fsyncs_the_directory_after_renames(tmp_path, monkeypatch):
    """The renames reach the disk (directory fsync) before the old copy is deleted, and after tracker and pruning."""
    root = tmp_path / "ck"
    save_version(root, 1, version=1)
    save_version(root, 2, version=2)
    events: list[tuple[str, str]] = []
    real_open, real_fsync, real_rmtree = os.open, os.fsync, shutil.rmtree
    real_replace, real_rename = os.replace, os.rename
    fds: dict[int, str] = {}

    def spy_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        fds[fd] = str(path)
        return fd

    def spy_fsync(fd):
        if fd in fds and os.path.isdir(fds[fd]):
            events.append(("fsync", Path(fds[fd]).name))
        return real_fsync(fd)

    def spy_move(real):
        def move(src, dst, *args, **kwargs):
            events.append(("move", f"{Path(src).name}->{Path(dst).name}"))
            return real(src, dst, *args, **kwargs)
        return move

    def spy_rmtree(path, *args, **kwargs):
        events.append(("rmtree", Path(path).name))
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_move(real_replace))
    monkeypatch.setattr(os, "rename", spy_move(real_rename))
    monkeypatch.setattr(shutil, "rmtree", spy_rmtree)
    save_version(root, 2, version=3, save_limit=1)
    monkeypatch.undo()

    def index(event):
        return next(i for i, e in enumerate(events) if e[0] == event[0] and event[1] in e[1])

    into_place = index(("move", ".global_step_2.tmp->global_step_2"))
    old_removed = index(("rmtree", ".global_step_2.old"))
    assert ("fsync", "ck") in events[into_place:old_removed]
    tracker = index(("move", f"->{ckpt.TRACKER}"))
    assert ("fsync", "ck") in events[tracker:]
    pruning = next(i for i, e in enumerate(events) if e[0] in ("move", "rmtree") and "global_step_1" in e[1])
    assert ("fsync", "ck") in events[pruning:]
    assert [s for s, _ in step_dirs(root)] == [2] and version_of(root / "global_step_2") == 3


# ---------------------------------------------------------------------------- logs on resume


def steps_in(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_truncate_jsonl_keeps_steps_up_to_max_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    lines = [json.dumps({"step": s, "text": "é" * 3}) for s in (1, 1, 2, 3, 3, 4)]
    torn = json.dumps({"step": 5, "text": "éé"}).encode()[:-4]  # cut inside a UTF-8 character
    path.write_bytes(("\n".join(lines) + "\n").encode() + torn)
    truncate_jsonl(path, 3)
    assert steps_in(path) == [1, 1, 2, 3, 3]
    truncate_jsonl(path, 10)  # nothing above max_step: unchanged
    assert steps_in(path) == [1, 1, 2, 3, 3]

    path.write_text("\n".join(lines) + "\n" + '{"step": 5, "te')  # torn, steps below max kept
    truncate_jsonl(path, 10)
    assert steps_in(path) == [1, 1, 2, 3, 3, 4]
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temp file left behind

    path.write_text("\n".join(lines))  # whole last record, its newline lost: kept, and later appends start a line
    truncate_jsonl(path, 10)
    with open(path, "a") as fh:
        fh.write(json.dumps({"step": 5}) + "\n")
    assert steps_in(path) == [1, 1, 2, 3, 3, 4, 5]
    truncate_jsonl(tmp_path / "missing.jsonl", 3)  # a file never written: nothing to do
    assert not (tmp_path / "missing.jsonl").exists()


def test_resumed_logs_hold_each_step_once(tmp_path):
    """Run to step 5, die, resume from the checkpoint at step 3: files and TensorBoard hold 1..6 once each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    logger = MetricsLogger(run, ["jsonl", "tensorboard"], total_steps=6)
    rollouts = RolloutWriter(run / "rollouts.jsonl")
    for step in range(1, 6):
        logger.log(step, {"reward/mean": float(step)})
        rollouts.write(step, [{"response": "a"}, {"response": "b"}])
    logger.close()
    rollouts.close()
    with open(run / "rollouts.jsonl", "a") as fh:  # the kill tore the line being written
        fh.write('{"step": 6, "respo')

    logger = MetricsLogger(run, ["jsonl", "tensorboard"], total_steps=6, initial_step=3, resume_step=3)
    rollouts = RolloutWriter(run / "rollouts.jsonl", resume_step=3)
    for step in range(4, 7):
        logger.log(step, {"reward/mean": 10.0 * step})
        rollouts.write(step, [{"response": "c"}, {"response": "d"}])
    logger.close()
    rollouts.close()

    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert [m["reward/mean"] for m in metrics] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]
    assert steps_in(run / "rollouts.jsonl") == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward/mean")
    assert [s.step for s in scalars] == [1, 2, 3, 4, 5, 6]
    assert [s.value for s in scalars] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]


def test_loggers_without_resume_step_append(tmp_path):
    """Existing callers (no resume_step) keep appending, as before."""
    run = tmp_path / "run"
    for _ in range(2):
        logger = MetricsLogger(run, ["jsonl"], total_steps=2, initial_step=0)
        logger.log(1, {"reward/mean": 1.0})
        logger.close()
        writer = RolloutWriter(run / "rollouts.jsonl")
        writer.write(1, [{"response": "a"}])
        writer.close()
    assert steps_in(run / "metrics.jsonl") == [1, 1]
    assert steps_in(run / "rollouts.jsonl") == [1, 1]


def test_schema_file_records_each_key_kind_once_and_only_on_the_main_process(tmp_path):
    from grouprl.trainer.metrics import SchemaFile, StepMetrics

    first, second = StepMetrics(), StepMetrics()
    first.mean("actor/clipfrac", 0.1)
    first.sum("actor/pg_loss", 0.5)
    second.moments("reward", [0.0, 1.0])
    schema = SchemaFile(tmp_path / "metrics_schema.json")
    schema.record(first)
    schema.record(second, "val/")
    assert json.loads((tmp_path / "metrics_schema.json").read_text()) == {
        "actor/clipfrac": "mean", "actor/pg_loss": "sum", "val/reward": "moments"}
    off = SchemaFile(tmp_path / "other.json", enabled=False)
    off.record(first)
    assert not (tmp_path / "other.json").exists()
