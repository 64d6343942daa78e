"""Checkpoints `global_step_N/`: model, optimizer, scheduler, RNG and data position.

Everything is safetensors or JSON; nothing is ever unpickled. A checkpoint is
written completely into a hidden temporary directory `.global_step_N.tmp`, made
durable, and renamed into place; a `global_step_N/` being re-saved is first
renamed aside to `.global_step_N.old` and deleted only once the new copy is on
disk. A kill at any point therefore leaves a complete `global_step_N/` or one of
these hidden copies, which `recover_interrupted_save` (run by every listing and
every save) puts back: readers never see a half-written or missing checkpoint.

`best/` (``trainer.best_metric``) is a checkpoint like the others, kept the same way (`.best.tmp`,
`.best.old`), and never listed by `step_dirs`: `save_limit` never prunes it and `trainer.resume: auto`
never picks it. `keep_best` makes it from the step checkpoint just written by hard-linking that
checkpoint's files (no second write of the model), `save_best` writes it when the step has none.

A complete checkpoint also holds `manifest.json`, written inside the temporary directory
before the rename: every file's size and SHA-256, and the facts the files must agree on
(step, number of processes, data position). A crash cannot damage a checkpoint, but a disk,
a copy or a person can; `resume_path` verifies a checkpoint against its manifest before a
run resumes from it, so that a damaged one is named and skipped instead of resumed silently.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from grouprl.config import ConfigError
from grouprl.errors import CheckpointSaveError
from grouprl.files import follow_umask, fsync_dir, write_text_atomic

STEP_DIR = re.compile(r"^global_step_(\d+)$")
BEST_DIR = "best"  # the best checkpoint by trainer.best_metric; not a step, so never pruned nor resumed by auto
# hidden copies of a step (or of best): being written (tmp), moved aside by a re-save (old), being pruned (del)
HIDDEN_DIR = re.compile(r"^\.(global_step_\d+|best)\.(tmp|old|del)$")
TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARK = "trainer_state.json"  # written last, after everything else is durable
MANIFEST = "manifest.json"  # every file's size and SHA-256, written just before COMPLETE_MARK
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20  # hashing reads 1 MiB at a time: checkpoints of real models are many GB


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed from (damaged, edited or unreadable); the message names the file.

    A ConfigError, since ``trainer.resume`` chose it: the command line reports it as one line.
    """


class CheckpointWarning(UserWarning):
    """A damaged checkpoint skipped by ``resume=auto``, or one resumed without a manifest to verify it."""


@dataclass
class TrainerState:
    """Where the run is: enough to continue it exactly."""

    global_step: int = 0
    epoch: int = 0
    batch_in_epoch: int = 0  # prompt batches of this epoch already consumed
    optimizer_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- optimizer state as safetensors + JSON


def _split_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    """Replace every tensor in a nested structure by a reference, collecting the tensors."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "root"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        # JSON keys are strings; remember int keys (optimizer param ids) to restore them
        return {
            "__dict__": [[k, _split_state(v, tensors, f"{prefix}.{k}" if prefix else str(k))] for k, v in obj.items()]
        }
    if isinstance(obj, (list, tuple)):
        items = [_split_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix}")


def _join_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: _join_state(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(_join_state(v, tensors) for v in obj["__tuple__"])
    if isinstance(obj, list):
        return [_join_state(v, tensors) for v in obj]
    return obj


def save_state_dict(state: dict, directory: Path, name: str) -> None:
    tensors: dict[str, torch.Tensor] = {}
    structure = _split_state(state, tensors, "")
    save_file(tensors, str(directory / f"{name}.safetensors"))
    (directory / f"{name}.json").write_text(json.dumps(structure))


@contextlib.contextmanager
def _reading(file: Path, what: str = "cannot be read"):
    """Re-raise what a damaged file makes a reader raise (a truncated safetensors header, bad JSON,
    a missing entry) as a CheckpointError naming the file, instead of e.g. a bare KeyError."""
    try:
        yield
    except CheckpointError:
        raise
    except (SafetensorError, OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"checkpoint file {file} {what}: {type(exc).__name__}: {exc}") from exc


def load_state_dict(directory: Path, name: str) -> dict:
    tensor_file, structure_file = directory / f"{name}.safetensors", directory / f"{name}.json"
    with _reading(tensor_file):
        tensors = load_file(str(tensor_file)) if tensor_file.exists() else {}
    with _reading(structure_file):
        structure = json.loads(structure_file.read_text())
    try:
        return _join_state(structure, tensors)
    except KeyError as exc:
        raise CheckpointError(f"checkpoint file {structure_file} refers to tensor {exc.args[0]!r}, "
                              f"which {tensor_file} does not hold") from None
    except (ValueError, TypeError, IndexError) as exc:
        raise CheckpointError(f"checkpoint file {structure_file} is malformed: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    # numpy's state holds an ndarray; make it JSON-able
    name, keys, pos, has_gauss, cached = state["numpy"]
    state["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]
    state["python"] = [state["python"][0], list(state["python"][1]), state["python"][2]]
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))


# ---------------------------------------------------------------------------- durable file operations


def _file_digest(path: Path, *, fsync: bool = False) -> dict:
    """A file's size and SHA-256, read in 1 MiB chunks into one buffer (optionally fsynced while open)."""
    digest, size = hashlib.sha256(), 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as fh:
        while n := fh.readinto(buffer):
            digest.update(view[:n])
            size += n
        if fsync:
            os.fsync(fh.fileno())
    return {"size": size, "sha256": digest.hexdigest()}


def _files_under(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def _each_file(fn, names: list[str]) -> dict[str, Any]:
    """``fn(name)`` for each file, several files at once (hashlib and file reads release the GIL)."""
    if not names:
        return {}
    workers = max(1, min(4, os.cpu_count() or 1, len(names)))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grouprl-hash") as pool:
        return dict(zip(names, pool.map(fn, names)))


def _digests(root: Path, names: list[str], *, fsync: bool = False) -> dict[str, dict]:
    """Size and SHA-256 of each file."""
    return _each_file(lambda name: _file_digest(root / name, fsync=fsync), names)


def _fsync_dirs(root: Path) -> None:
    """fsync every directory under root, deepest first (their files are fsynced already)."""
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    for directory in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(directory)


def _remove_tree(path: Path) -> None:
    """Delete a directory; one that is already gone (another process cleaned it up) is fine."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        raise OSError(f"could not remove {path}")


def _move(src: Path, dst: Path) -> None:
    """Rename src to dst; src already gone means another process recovering the same root got there first."""
    with contextlib.suppress(FileNotFoundError):
        os.replace(src, dst)


# ---------------------------------------------------------------------------- save / load / prune


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / COMPLETE_MARK).exists()


def recover_interrupted_save(root: Path) -> None:
    """Finish or undo what a save killed midway left behind, so that each step has its complete `global_step_N/`
    (and `best/` its complete copy).

    For a step whose `global_step_N/` is missing, the copy a re-save had moved aside (complete: it was
    a checkpoint) is restored, else a complete temporary copy is promoted. Every other hidden copy is
    stale and removed. Idempotent, and safe when several processes recover the same root at once;
    it must not run while another process is saving into root.
    """
    if not root.is_dir():
        return
    hidden: dict[str, dict[str, Path]] = {}
    for child in root.iterdir():
        m = HIDDEN_DIR.match(child.name)
        if m:
            hidden.setdefault(m.group(1), {})[m.group(2)] = child
    if not hidden:
        return
    for name, copies in hidden.items():
        final = root / name
        if not final.exists():
            if "old" in copies:
                _move(copies.pop("old"), final)
            elif "tmp" in copies and _is_complete(copies["tmp"]):
                _move(copies.pop("tmp"), final)
    fsync_dir(root)  # the restored names are durable before any other copy goes
    for copies in hidden.values():
        for path in copies.values():
            _remove_tree(path)
    fsync_dir(root)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Completed checkpoints under root, oldest first (after recovering from an interrupted save)."""
    if not root.exists():
        return []
    recover_interrupted_save(root)
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and _is_complete(child):
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    dirs = step_dirs(root)
    return dirs[-1][1] if dirs else None


# ---------------------------------------------------------------------------- verification


@dataclass
class Verification:
    """What ``verify_checkpoint`` found: each problem names the file (and the field) at fault."""

    path: Path
    problems: list[str]
    has_manifest: bool

    @property
    def intact(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        return "; ".join(self.problems)


def _tensor_refs(structure: Any) -> set[str]:
    """The tensor names a ``save_state_dict`` structure refers to."""
    if isinstance(structure, dict):
        if "__tensor__" in structure:
            return {str(structure["__tensor__"])}
        return set().union(*(_tensor_refs(v) for v in structure.values()))
    if isinstance(structure, list):
        return set().union(*(_tensor_refs(v) for v in structure))
    return set()


def _readable(path: Path, names: list[str], skip: set[str], problems: list[str]) -> dict[str, Any]:
    """Open every safetensors header and parse every JSON file (cheap: no tensor data is read).

    Checks that each ``name.json`` structure refers only to tensors its ``name.safetensors`` holds
    (the bare KeyError a resume would otherwise die with). Returns the parsed top-level JSON files.
    """
    headers: dict[str, set[str]] = {}
    parsed: dict[str, Any] = {}
    for name in names:
        if name in skip:
            continue
        try:
            if name.endswith(".safetensors"):
                with safe_open(str(path / name), framework="pt") as fh:
                    headers[name] = set(fh.keys())
            elif name.endswith(".json"):
                structure = json.loads((path / name).read_text())
                if "/" not in name:  # the model's own JSON files need only parse
                    parsed[name] = structure
        except (SafetensorError, OSError, ValueError) as exc:
            problems.append(f"{name}: cannot be read ({type(exc).__name__}: {exc})")
    for name, structure in parsed.items():
        stem = name[: -len(".json")]
        tensor_file = f"{stem}.safetensors"
        if tensor_file in names and tensor_file not in headers:
            continue  # its tensor file is damaged, and reported already
        missing = sorted(_tensor_refs(structure) - headers.get(tensor_file, set()))
        if missing:
            problems.append(f"{name}: refers to {len(missing)} tensor(s) that {stem}.safetensors does not hold "
                            f"(e.g. {missing[0]!r})")
    return parsed


def _rng_processes(structure: Any) -> int | None:
    """How many processes' RNG states an rng.json structure holds (None for a single, old-style state)."""
    if isinstance(structure, dict):
        for key, value in structure.get("__dict__", []):
            if key == "processes" and isinstance(value, list):
                return len(value)
    return None


def verify_checkpoint(path: Path, *, checksums: bool = True) -> Verification:
    """Check a checkpoint against its manifest, and its files against each other. Raises nothing.

    Every file the manifest lists must be there with its size and SHA-256 (``checksums`` False:
    its size only, for files known to be the ones just hashed, e.g. hard links to them), and no other file may be;
    every file must be readable; the step in the directory name, trainer_state.json and the manifest
    must agree, as must the data position and the number of processes the RNG states were saved by.
    A checkpoint saved before manifests existed is checked for all but the sizes and checksums.
    Costs one read of every file (SHA-256: 0.5 to 1.7 GB/s a core; up to 4 files hash at once).
    """
    path = Path(path)
    problems: list[str] = []
    if not path.is_dir():
        return Verification(path, [f"{path} does not exist or is not a directory"], False)
    present = _files_under(path)
    mark: dict | None = None
    if COMPLETE_MARK not in present:
        problems.append(f"{COMPLETE_MARK}: missing (the save did not complete, or the file was deleted)")
    else:
        try:
            mark = _read_mark(path)
        except CheckpointError as exc:
            problems.append(f"{COMPLETE_MARK}: cannot be read ({exc.__cause__ or exc})")

    manifest: dict | None = None
    if MANIFEST in present:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
            files = manifest.get("files") if isinstance(manifest, dict) else None
            if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
                raise ValueError("no 'files' table of sizes and checksums")
        except (OSError, ValueError) as exc:
            problems.append(f"{MANIFEST}: cannot be read ({type(exc).__name__}: {exc})")
            manifest = None
    elif mark is not None and mark.get("manifest"):
        problems.append(f"{MANIFEST}: missing, though {COMPLETE_MARK} says the checkpoint was saved with one")
    has_manifest = MANIFEST in present

    # sizes and checksums: the one check that sees flipped bytes or an edited value
    damaged: set[str] = set()
    if manifest is not None:
        listed: dict = manifest["files"]
        for name in sorted(set(present) - set(listed) - {MANIFEST}):
            problems.append(f"{name}: not in the manifest (added after the save)")
            damaged.add(name)
        sized = []
        for name, want in sorted(listed.items()):
            if name not in present:
                problems.append(f"{name}: missing (the manifest lists it)")
                damaged.add(name)
            elif (size := (path / name).stat().st_size) != want.get("size"):
                problems.append(f"{name}: {size} bytes, the manifest says {want.get('size')} (truncated or rewritten)")
                damaged.add(name)
            else:
                sized.append(name)
        def digest(name: str) -> dict | OSError:
            try:
                return _file_digest(path / name)
            except OSError as exc:
                return exc

        for name, got in (_each_file(digest, sized) if checksums else {}).items():
            if isinstance(got, OSError):
                problems.append(f"{name}: cannot be read ({got})")
                damaged.add(name)
            elif got["sha256"] != listed[name].get("sha256"):
                problems.append(f"{name}: SHA-256 differs from the manifest's (the file changed after the save)")
                damaged.add(name)

    parsed = _readable(path, present, damaged | {MANIFEST, COMPLETE_MARK}, problems)

    # the facts the files must agree on; each names the file and the field that disagree
    if mark is not None:
        step = mark.get("global_step")
        m = STEP_DIR.match(path.name)
        if m and step != int(m.group(1)):
            problems.append(f"{COMPLETE_MARK}: global_step is {step}, but the directory is {path.name}")
        extra = mark.get("extra")
        position = extra.get("stream") if isinstance(extra, dict) else None
        if manifest is not None:
            if manifest.get("global_step") != step:
                problems.append(f"{COMPLETE_MARK}: global_step is {step}, {MANIFEST} says "
                                f"{manifest.get('global_step')}")
            if manifest.get("data_position") != position:
                problems.append(f"{COMPLETE_MARK}: the data position (extra.stream) is {position}, "
                                f"{MANIFEST} says {manifest.get('data_position')}")
        if isinstance(position, dict):
            for key in ("epoch", "batch_in_epoch"):
                if key in position and key in mark and position[key] != mark[key]:
                    problems.append(f"{COMPLETE_MARK}: {key} is {mark[key]}, the data position (extra.stream) "
                                    f"says {position[key]}")
    if manifest is not None and "rng.json" in parsed:
        saved_by = _rng_processes(parsed["rng.json"])
        if saved_by is not None and saved_by != manifest.get("num_processes"):
            problems.append(f"rng.json: holds {saved_by} process(es)' RNG states, {MANIFEST} says the run had "
                            f"{manifest.get('num_processes')}")
    return Verification(path, problems, has_manifest)


def _unverified_warning(path: Path) -> None:
    warnings.warn(f"checkpoint {path} has no {MANIFEST} (saved by an older grouprl): its files cannot be "
                  "verified; resuming from it anyway", CheckpointWarning, stacklevel=3)


def _choose_checkpoint(resume: str, root: Path) -> Path | None:
    if resume != "auto":
        path = Path(resume)
        found = verify_checkpoint(path)
        if not found.intact:
            raise CheckpointError(f"config key 'trainer.resume' names checkpoint {path}, which is damaged: "
                                  f"{found.describe()}")
        if not found.has_manifest:
            _unverified_warning(path)
        return path
    step_dirs(root)  # finishes an interrupted save first
    candidates = sorted(((int(m.group(1)), child) for child in (root.iterdir() if root.is_dir() else [])
                         if (m := STEP_DIR.match(child.name)) and child.is_dir()), reverse=True)
    skipped: list[Verification] = []
    for _, path in candidates:
        found = verify_checkpoint(path)
        if not found.intact:
            skipped.append(found)
            continue
        for bad in skipped:
            warnings.warn(f"checkpoint {bad.path} is damaged, resuming from {path} instead: {bad.describe()}",
                          CheckpointWarning, stacklevel=3)
        if not found.has_manifest:
            _unverified_warning(path)
        return path
    if skipped:
        listing = " | ".join(f"{bad.path.name}: {bad.describe()}" for bad in skipped)
        raise CheckpointError(f"trainer.resume=auto: no intact checkpoint under {root} (move the damaged ones "
                              f"away to start afresh): {listing}")
    return None


def resume_path(resume: str | None, root: Path, *, accelerator=None) -> Path | None:
    """The checkpoint ``trainer.resume`` names, verified: "auto" the newest intact one under ``root``
    (None with nothing saved yet: a fresh start), a path that one, empty or None none.

    ``auto`` skips a damaged checkpoint with a CheckpointWarning naming what is wrong with it; a damaged
    path, or nothing intact under ``root``, is a CheckpointError. With an ``accelerator`` of several
    processes the main process alone verifies (and warns), and tells the others what it chose.
    """
    if not resume:
        return None
    several = accelerator is not None and accelerator.num_processes > 1
    outcome: tuple[str, str | None] | None = None
    failure: Exception | None = None
    if not several or accelerator.is_main_process:
        try:
            chosen = _choose_checkpoint(resume, Path(root))
            outcome = ("path", None if chosen is None else str(chosen))
        except Exception as exc:  # told to the other processes first, which would otherwise wait forever
            failure = exc
            outcome = ("error", str(exc) if isinstance(exc, CheckpointError) else
                       f"the main process could not choose a checkpoint: {type(exc).__name__}: {exc}")
    if several:
        from accelerate.utils import broadcast_object_list

        outcome = broadcast_object_list([outcome], from_process=0)[0]
    if failure is not None:
        raise failure
    kind, value = outcome
    if kind == "error":
        raise CheckpointError(value)
    return None if value is None else Path(value)


def _write_checkpoint(tmp: Path, state: TrainerState, model, optimizer, scheduler, processor,
                      rng_states: list[dict] | None, model_state_dict: dict | None, extras=None) -> None:
    """Everything into tmp, durably; trainer_state.json last so that its presence means the rest is on disk."""
    tmp.mkdir()
    gathered = {"state_dict": model_state_dict} if model_state_dict is not None else {}
    model.save_pretrained(tmp / "model", safe_serialization=True, **gathered)
    if processor is not None:
        processor.save_pretrained(tmp / "model")
    if extras is not None:  # a trainer's own files beside the weights (the flow trainer's moving average)
        extras(tmp / "model")
    if optimizer is not None:
        state_dict = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        save_state_dict(state_dict, tmp, "optimizer")
    if scheduler is not None:
        save_state_dict(scheduler.state_dict(), tmp, "scheduler")
    # one RNG state per process: each draws its own dropout masks and reward noise
    processes = rng_states if rng_states is not None else [rng_state()]
    save_state_dict({"processes": processes}, tmp, "rng")
    # one read of every file, right after writing it (from the page cache): hashed and fsynced
    files = _digests(tmp, _files_under(tmp), fsync=True)
    # the mark says the checkpoint has a manifest, so that a deleted manifest is told from an old checkpoint
    mark = json.dumps({**asdict(state), "manifest": MANIFEST}, indent=2)
    files[COMPLETE_MARK] = {"size": len(mark.encode()), "sha256": hashlib.sha256(mark.encode()).hexdigest()}
    manifest = {"format": MANIFEST_FORMAT, "global_step": state.global_step, "num_processes": len(processes),
                "data_position": state.extra.get("stream"), "files": dict(sorted(files.items()))}
    write_text_atomic(tmp / MANIFEST, json.dumps(manifest, indent=2))
    _fsync_dirs(tmp)
    # atomic too: a kill while it is written must not leave a partial mark that reads as complete
    write_text_atomic(tmp / COMPLETE_MARK, mark)


def _prune(root: Path, save_limit: int, keep: Path) -> None:
    """Keep the newest save_limit checkpoints and ``keep``; each old one is renamed away first, so none is
    ever half deleted.

    ``keep`` is the checkpoint just written, intact by construction. A run that fell back past a damaged
    newer checkpoint saves below it: counting only the newest, pruning would delete the one intact copy.
    """
    doomed = []
    for step, path in step_dirs(root)[:-save_limit]:
        if path == keep:
            continue
        trash = root / f".global_step_{step}.del"
        os.replace(path, trash)
        doomed.append(trash)
    if doomed:
        fsync_dir(root)
        for trash in doomed:
            _remove_tree(trash)


def _remove_tree_quietly(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _save_failed(final: Path, root: Path, exc: BaseException) -> CheckpointSaveError:
    """The one-line error of a checkpoint the disk would not take: its path, the system's reason, and
    the checkpoint a resumed run starts from instead."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    if (getattr(exc, "errno", None) == errno.ENOSPC or "StorageFull" in str(exc)
            or "No space left on device" in str(exc)):  # safetensors says it in its own message
        reason = "no space left on device"
    previous = [path for _, path in step_dirs(root)]
    kept = (f"the previous checkpoint {previous[-1]} is intact (trainer.resume=auto resumes from it)" if previous
            else "no earlier checkpoint exists")
    return CheckpointSaveError(f"could not write checkpoint {final}: {reason}; nothing of it was kept, {kept}",
                               str(final), exc.errno if isinstance(exc, OSError) else None)


def _install(root: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``; an existing ``final`` is moved aside (``.NAME.old``), not
    deleted, so that between the two renames one complete copy always exists, and removed once the new one's
    name is durable."""
    aside = root / f".{final.name}.old"
    replacing = final.exists()
    if replacing:
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(root)  # the new copy's name is durable before the old copy is deleted
    if replacing:
        _remove_tree(aside)


def _save_as(root: Path, name: str, state: TrainerState, model, optimizer, scheduler, processor,
             rng_states: list[dict] | None, model_state_dict: dict | None, extras=None) -> Path:
    """Write the checkpoint ``root/name`` atomically (see :func:`save_checkpoint`)."""
    root.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(root)
    final, tmp = root / name, root / f".{name}.tmp"
    try:
        _write_checkpoint(tmp, state, model, optimizer, scheduler, processor, rng_states, model_state_dict, extras)
        follow_umask(tmp)  # safetensors writes 0600 files: the team could not read the checkpoint
    except (OSError, SafetensorError) as exc:  # a full disk, a quota: safetensors reports it as its own error
        _remove_tree_quietly(tmp)  # never complete (the mark is written last), so never promoted; the space back
        raise _save_failed(final, root, exc) from exc
    _install(root, tmp, final)
    return final


def save_checkpoint(
    root: Path,
    state: TrainerState,
    model,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    *,
    processor=None,
    save_limit: int = -1,
    rng_states: list[dict] | None = None,
    model_state_dict: dict | None = None,
    extras=None,
) -> Path:
    """Write ``root/global_step_N`` atomically and prune to ``save_limit`` checkpoints.

    ``optimizer`` is an optimizer or its already gathered state dict (a sharded run
    gathers it on the main process first, see ``parallel.full_state_dicts``), as is
    ``model_state_dict`` for a sharded model. ``rng_states`` holds every process's
    ``rng_state()``, in process order (default: this process's). ``extras(model_dir)`` writes a
    trainer's own files beside the weights, inside the same atomic write.
    A kill at any point leaves step N complete, as the previous save or as this one. A write that
    fails (a full disk) removes what it wrote and raises :class:`~grouprl.errors.CheckpointSaveError`
    naming the checkpoint and the reason; the checkpoints already on disk are untouched.
    """
    final = _save_as(root, f"global_step_{state.global_step}", state, model, optimizer, scheduler, processor,
                     rng_states, model_state_dict, extras)
    write_text_atomic(root / TRACKER, str(state.global_step))
    if save_limit > 0:
        _prune(root, save_limit, keep=final)
    return final


def save_best(root: Path, state: TrainerState, model, optimizer, scheduler, *, processor=None,
              rng_states: list[dict] | None = None, model_state_dict: dict | None = None, extras=None) -> Path:
    """Write ``root/best`` as :func:`save_checkpoint` writes a step (atomically, with its manifest), for a
    step that has no checkpoint of its own; the previous ``best/`` stays until this one is complete.
    The tracker of the latest step and pruning are left alone."""
    return _save_as(root, BEST_DIR, state, model, optimizer, scheduler, processor, rng_states, model_state_dict,
                    extras)


def keep_best(root: Path, source: Path) -> Path:
    """Make ``root/best`` a copy of the intact checkpoint ``source`` (the step checkpoint just written),
    atomically: its files hard-linked (no second write of the model; safe, since a checkpoint's files
    are never written in place: a re-save or a prune renames and deletes, which leaves the links),
    copied where the file system refuses links.

    The copy is verified against ``source``'s manifest before it replaces the previous ``best/``: the
    names and sizes of every file, and the SHA-256 of any file that had to be copied (a linked file is
    the file the save just hashed). ``trainer_state.json`` is linked last, so that a kill midway leaves
    an incomplete ``.best.tmp`` that recovery deletes, and the previous ``best/`` in place.
    """
    recover_interrupted_save(root)
    final, tmp = root / BEST_DIR, root / f".{BEST_DIR}.tmp"
    copied = False
    try:
        _remove_tree(tmp)
        tmp.mkdir()
        names = _files_under(source)
        for name in sorted(names, key=lambda n: n == COMPLETE_MARK):
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / name, tmp / name)
            except OSError:  # no hard links here (some network and FUSE file systems): a copy, verified below
                shutil.copy2(source / name, tmp / name)
                with open(tmp / name, "rb") as fh:  # durable before the rename, as a save's files are
                    os.fsync(fh.fileno())
                copied = True
        found = verify_checkpoint(tmp, checksums=copied)
        if not found.intact:
            raise CheckpointError(f"the copy of checkpoint {source} as {final} does not match its manifest: "
                                  f"{found.describe()}")
        _fsync_dirs(tmp)
    except OSError as exc:
        _remove_tree_quietly(tmp)
        raise _save_failed(final, root, exc) from exc
    except CheckpointError:
        _remove_tree_quietly(tmp)
        raise
    _install(root, tmp, final)
    return final


def _read_mark(path: Path) -> dict:
    with _reading(path / COMPLETE_MARK):
        saved = json.loads((path / COMPLETE_MARK).read_text())
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
        return saved


def load_trainer_state(path: Path) -> TrainerState:
    saved = _read_mark(path)
    saved.pop("manifest", None)  # says the checkpoint was saved with one; not part of the run's state
    with _reading(path / COMPLETE_MARK, "does not hold a trainer state"):
        return TrainerState(**saved)


def load_model_weights(model, path: Path) -> None:
    """Load the weights saved by ``save_checkpoint`` into an already built model (full, LoRA or sharded)."""
    model_dir = path / "model"
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        with _reading(adapter):
            weights = load_file(str(adapter))
        set_peft_model_state_dict(model, weights)
        return
    weight_files = sorted(model_dir.glob("*.safetensors"))
    if not weight_files:
        raise CheckpointError(f"checkpoint {path} has no model weights in {model_dir}")
    # save_pretrained may write keys in the checkpoint layout of the hub (transformers
    # renames e.g. Qwen2.5-VL's `model.visual` to `visual` on save), so read them back
    # through from_pretrained, which applies the same conversion in reverse.
    from grouprl.trainer.parallel import is_sharded, load_full_state_dicts

    model_class = _plain_class(model) if is_sharded(model) else type(model)
    names = ", ".join(f.name for f in weight_files)
    with _reading(model_dir / (names if len(weight_files) == 1 else f"{{{names}}}")):
        saved = model_class.from_pretrained(str(model_dir), dtype=next(model.parameters()).dtype)
    if is_sharded(model):
        load_full_state_dicts(model, None, saved.state_dict(), None)
        return
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def _plain_class(model) -> type:
    # FSDP2 swaps a sharded module's class for a subclass of the original
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__[1:] if not issubclass(c, FSDPModule))


def _by_name(optimizer_state: dict) -> bool:
    """Whether an optimizer state is keyed by parameter name (gathered whole) or by position."""
    return all(isinstance(k, str) for k in optimizer_state.get("state", {}))


def restore_checkpoint(path: Path, model, optimizer, scheduler, *, process_index: int = 0,
                       num_processes: int = 1) -> TrainerState:
    """Load a checkpoint into the model, optimizer and scheduler, and this process's RNG state.

    The RNG state is the one this process saved; a run resumed on another number of
    processes continues (with a warning), but not bit for bit.
    """
    load_model_weights(model, path)
    if optimizer is not None:
        saved = load_state_dict(path, "optimizer")
        with _reading(path / "optimizer.json", "does not fit this run's optimizer"):
            if _by_name(saved):
                from grouprl.trainer.parallel import load_full_state_dicts

                load_full_state_dicts(model, optimizer, None, saved)
            else:
                optimizer.load_state_dict(saved)
    if scheduler is not None:
        saved = load_state_dict(path, "scheduler")
        with _reading(path / "scheduler.json", "does not fit this run's scheduler"):
            scheduler.load_state_dict(saved)
    rng = load_state_dict(path, "rng")
    with _reading(path / "rng.json", "does not hold RNG states"):
        states = rng["processes"] if "processes" in rng else [rng]
        if len(states) != num_processes:
            warnings.warn(f"checkpoint {path} was saved by {len(states)} process(es) (rng.json), resumed on "
                          f"{num_processes}: the run continues, but not exactly as it would have", stacklevel=2)
        set_rng_state(states[process_index % len(states)])
    return load_trainer_state(path)
