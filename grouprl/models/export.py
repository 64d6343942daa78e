"""Writing a policy out as a plain Hugging Face model directory (LoRA merged in)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from grouprl.errors import ModelPathError
from grouprl.files import follow_umask


def save_merged(model, processor, out_dir: str | Path, *, state_dict: dict | None = None) -> Path:
    """Save ``model`` (a PeftModel is merged first) and its processor to ``out_dir`` atomically.

    ``state_dict``: the whole model's weights when ``model`` itself holds only a shard (FSDP).

    The directory appears complete or not at all: it is written beside its final
    place and renamed, so an interrupted export never leaves a half model behind.
    """
    out = Path(out_dir)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if processor is not None:
        processor.save_pretrained(tmp)
    follow_umask(tmp)  # safetensors writes 0600 files
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _not_a_checkpoint(checkpoint: str) -> ModelPathError:
    """What ``checkpoint`` (no ``model/`` directory in it) is instead, and what to export."""
    from grouprl.models.loading import run_checkpoints

    path = Path(checkpoint).expanduser()
    if not path.exists():
        return ModelPathError(f"checkpoint {checkpoint} does not exist", checkpoint)
    if (path / "config.json").exists():
        return ModelPathError(f"{checkpoint} is a model directory, not a grouprl checkpoint: it needs no export "
                              f"(use it as it is, e.g. grouprl generate --model {checkpoint})", checkpoint)
    found = run_checkpoints(path)
    if found:
        return ModelPathError(f"{checkpoint} is a grouprl run directory, not a checkpoint; export one of its "
                              f"checkpoints, e.g. the latest: grouprl export {found[-1]} --out merged/", checkpoint)
    return ModelPathError(f"{checkpoint} is not a grouprl checkpoint (no model/ directory); export a "
                          "checkpoint directory, runs/<run>/checkpoints/global_step_N", checkpoint)


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, base_model: str | None = None, dtype: str = "float32") -> Path:
    """Turn ``global_step_N/`` into a standalone model: LoRA adapters are merged into ``base_model``."""
    from grouprl.models.loading import load_model_and_processor

    model_dir = Path(checkpoint) / "model"
    if not model_dir.is_dir():
        raise _not_a_checkpoint(str(checkpoint))
    if (model_dir / "adapter_config.json").exists():
        from peft import PeftModel

        import json

        base = base_model or json.loads((model_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base:
            raise ModelPathError(f"{checkpoint} holds a LoRA adapter that records no base model; pass the base "
                                 "model it was trained from (grouprl export --base-model PATH)", str(checkpoint))
        model, processor, _ = load_model_and_processor(base, dtype=dtype)
        model = PeftModel.from_pretrained(model, str(model_dir))
    else:
        model, processor, _ = load_model_and_processor(str(model_dir), dtype=dtype)
    return save_merged(model, processor, out_dir)
