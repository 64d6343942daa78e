"""Checkpoints `global_step_N/`: model, optimizer, scheduler, RNG and data position.

Everything is safetensors or JSON; nothing is ever unpickled. A checkpoint is
written into a hidden temporary directory and renamed into place, so a run killed
mid-save leaves the previous checkpoint intact and no half-written
`global_step_N/` behind.
"""

from __future__ import annotations

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

STEP_DIR = re.compile(r"^global_step_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"


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


# ---------------------------------------------------------------------------- save / load / prune


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Completed checkpoints under root, oldest first."""
    if not root.exists():
        return []
    found = []
    for child in root.iterdir():
        m = STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / "trainer_state.json").exists():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    dirs = step_dirs(root)
    return dirs[-1][1] if dirs else None


def save_checkpoint(
    root: Path,
    state: TrainerState,
    model,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    *,
    processor=None,
    save_limit: int = -1,
) -> Path:
    """Write ``root/global_step_N`` atomically and prune to ``save_limit`` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"global_step_{state.global_step}"
    tmp = root / f".global_step_{state.global_step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    if processor is not None:
        processor.save_pretrained(tmp / "model")
    if optimizer is not None:
        save_state_dict(optimizer.state_dict(), tmp, "optimizer")
    if scheduler is not None:
        save_state_dict(scheduler.state_dict(), tmp, "scheduler")
    save_state_dict(rng_state(), tmp, "rng")
    # trainer_state.json is written last: its presence marks a complete checkpoint
    (tmp / "trainer_state.json").write_text(json.dumps(asdict(state), indent=2))
    for path in tmp.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    tracker_tmp = root / f".{TRACKER}.tmp"
    tracker_tmp.write_text(str(state.global_step))
    os.replace(tracker_tmp, root / TRACKER)
    if save_limit > 0:
        for _, old in step_dirs(root)[:-save_limit]:
            shutil.rmtree(old)
    return final


def load_trainer_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads((path / "trainer_state.json").read_text()))


def load_model_weights(model, path: Path) -> None:
    """Load the weights saved by ``save_checkpoint`` into an already built model (full or LoRA)."""
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
    saved = type(model).from_pretrained(str(model_dir), dtype=next(model.parameters()).dtype)
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )


def restore_checkpoint(path: Path, model, optimizer, scheduler) -> TrainerState:
    load_model_weights(model, path)
    if optimizer is not None:
        optimizer.load_state_dict(load_state_dict(path, "optimizer"))
    if scheduler is not None:
        scheduler.load_state_dict(load_state_dict(path, "scheduler"))
    set_rng_state(load_state_dict(path, "rng"))
    return load_trainer_state(path)
