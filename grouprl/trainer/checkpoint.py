"""Checkpoints `global_step_N/`: model, optimizer, scheduler, RNG and data position.

Everything is safetensors or JSON; nothing is ever unpickled. A checkpoint is
written completely into a hidden temporary directory `.global_step_N.tmp`, made
durable, and renamed into place; a `global_step_N/` being re-saved is first
renamed aside to `.global_step_N.old` and deleted only once the new copy is on
disk. A kill at any point therefore leaves a complete `global_step_N/` or one of
these hidden copies, which `recover_interrupted_save` (run by every listing and
every save) puts back: readers never see a half-written or missing checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from grouprl.files import fsync_dir, write_text_atomic

STEP_DIR = re.compile(r"^global_step_(\d+)$")
# hidden copies of a step: being written (tmp), moved aside by a re-save (old), being pruned (del)
HIDDEN_DIR = re.compile(r"^\.global_step_(\d+)\.(tmp|old|del)$")
TRACKER = "latest_checkpointed_iteration.txt"
COMPLETE_MARK = "trainer_state.json"  # written last, after everything else is durable


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


def load_state_dict(directory: Path, name: str) -> dict:
    tensors = load_file(str(directory / f"{name}.safetensors")) if (directory / f"{name}.safetensors").exists() else {}
    structure = json.loads((directory / f"{name}.json").read_text())
    return _join_state(structure, tensors)


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


def _fsync_tree(root: Path) -> None:
    """fsync every file under root, then every directory, deepest first."""
    dirs = [root]
    for path in sorted(root.rglob("*")):
        if path.is_dir():
            dirs.append(path)
        elif path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
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
    """Finish or undo what a save killed midway left behind, so that each step has its complete `global_step_N/`.

    For a step whose `global_step_N/` is missing, the copy a re-save had moved aside (complete: it was
    a checkpoint) is restored, else a complete temporary copy is promoted. Every other hidden copy is
    stale and removed. Idempotent, and safe when several processes recover the same root at once;
    it must not run while another process is saving into root.
    """
    if not root.is_dir():
        return
    hidden: dict[int, dict[str, Path]] = {}
    for child in root.iterdir():
        m = HIDDEN_DIR.match(child.name)
        if m:
            hidden.setdefault(int(m.group(1)), {})[m.group(2)] = child
    if not hidden:
        return
    for step, copies in hidden.items():
        final = root / f"global_step_{step}"
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


def resume_path(resume: str | None, root: Path) -> Path | None:
    """The checkpoint ``trainer.resume`` names: "auto" the latest complete one under ``root``
    (None with nothing saved yet: a fresh start), a path that one, empty or None none."""
    if not resume:
        return None
    return latest_checkpoint(root) if resume == "auto" else Path(resume)


def _write_checkpoint(tmp: Path, state: TrainerState, model, optimizer, scheduler, processor,
                      rng_states: list[dict] | None, model_state_dict: dict | None) -> None:
    """Everything into tmp, durably; trainer_state.json last so that its presence means the rest is on disk."""
    tmp.mkdir()
    gathered = {"state_dict": model_state_dict} if model_state_dict is not None else {}
    model.save_pretrained(tmp / "model", safe_serialization=True, **gathered)
    if processor is not None:
        processor.save_pretrained(tmp / "model")
    if optimizer is not None:
        state_dict = optimizer.state_dict() if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        save_state_dict(state_dict, tmp, "optimizer")
    if scheduler is not None:
        save_state_dict(scheduler.state_dict(), tmp, "scheduler")
    # one RNG state per process: each draws its own dropout masks and reward noise
    save_state_dict({"processes": rng_states if rng_states is not None else [rng_state()]}, tmp, "rng")
    _fsync_tree(tmp)
    # atomic too: a kill while it is written must not leave a partial mark that reads as complete
    write_text_atomic(tmp / COMPLETE_MARK, json.dumps(asdict(state), indent=2))


def _prune(root: Path, save_limit: int) -> None:
    """Keep the newest save_limit checkpoints; each old one is renamed away first, so none is ever half deleted."""
    doomed = []
    for step, path in step_dirs(root)[:-save_limit]:
        trash = root / f".global_step_{step}.del"
        os.replace(path, trash)
        doomed.append(trash)
    if doomed:
        fsync_dir(root)
        for trash in doomed:
            _remove_tree(trash)


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
) -> Path:
    """Write ``root/global_step_N`` atomically and prune to ``save_limit`` checkpoints.

    ``optimizer`` is an optimizer or its already gathered state dict (a sharded run
    gathers it on the main process first, see ``parallel.full_state_dicts``), as is
    ``model_state_dict`` for a sharded model. ``rng_states`` holds every process's
    ``rng_state()``, in process order (default: this process's).
    A kill at any point leaves step N complete, as the previous save or as this one.
    """
    root.mkdir(parents=True, exist_ok=True)
    recover_interrupted_save(root)
    final = root / f"global_step_{state.global_step}"
    tmp = root / f".global_step_{state.global_step}.tmp"
    aside = root / f".global_step_{state.global_step}.old"
    _write_checkpoint(tmp, state, model, optimizer, scheduler, processor, rng_states, model_state_dict)
    # a re-saved step is moved aside, not deleted: between the two renames it still exists
    replacing = final.exists()
    if replacing:
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_dir(root)  # the new copy's name is durable before the old copy is deleted
    if replacing:
        _remove_tree(aside)
    write_text_atomic(root / TRACKER, str(state.global_step))
    if save_limit > 0:
        _prune(root, save_limit)
    return final


def load_trainer_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def load_model_weights(model, path: Path) -> None:
    """Load the weights saved by ``save_checkpoint`` into an already built model (full, LoRA or sharded)."""
    model_dir = path / "model"
    adapter = model_dir / "adapter_model.safetensors"
    if adapter.exists():
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(adapter)))
        return
    if not list(model_dir.glob("*.safetensors")):
        raise FileNotFoundError(f"checkpoint {path} has no model weights in {model_dir}")
    # save_pretrained may write keys in the checkpoint layout of the hub (transformers
    # renames e.g. Qwen2.5-VL's `model.visual` to `visual` on save), so read them back
    # through from_pretrained, which applies the same conversion in reverse.
    from grouprl.trainer.parallel import is_sharded, load_full_state_dicts

    model_class = _plain_class(model) if is_sharded(model) else type(model)
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
        if _by_name(saved):
            from grouprl.trainer.parallel import load_full_state_dicts

            load_full_state_dicts(model, optimizer, None, saved)
        else:
            optimizer.load_state_dict(saved)
    if scheduler is not None:
        scheduler.load_state_dict(load_state_dict(path, "scheduler"))
    rng = load_state_dict(path, "rng")
    states = rng["processes"] if "processes" in rng else [rng]
    if len(states) != num_processes:
        import warnings

        warnings.warn(f"checkpoint {path} was saved by {len(states)} process(es), resumed on {num_processes}: "
                      "the run continues, but not exactly as it would have", stacklevel=2)
    set_rng_state(states[process_index % len(states)])
    return load_trainer_state(path)
