"""Writing a policy out as a plain Hugging Face model directory (LoRA merged in), or as its LoRA adapter.

A checkpoint of a model transformers loads (the language and vision-language runs) is
exported merged: the adapter folded into its base model. A flow run's checkpoint (a LoRA
adapter of a diffusers transformer, ``kind: flow``) is exported as the adapter itself, a
PEFT directory to load onto the pipeline's transformer; with ``ema`` the adapter's weights
are the moving average the checkpoint holds beside them (``model/ema.safetensors``), the
weights the run validated with.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from grouprl.errors import ModelPathError
from grouprl.files import follow_umask

EMA_FILE = "ema.safetensors"  # a checkpoint's moving average of the trained weights, in model/
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, base_model: str | None = None,
                      dtype: str = "float32", ema: bool = False) -> Path:
    """Turn ``global_step_N/`` into a standalone model: LoRA adapters are merged into ``base_model``.

    A flow run's checkpoint, or any with ``ema``, is written as its LoRA adapter instead
    (``export_adapter``).
    """
    from grouprl.models.loading import load_model_and_processor

    model_dir = Path(checkpoint) / "model"
    if not model_dir.is_dir():
        raise _not_a_checkpoint(str(checkpoint))
    if ema or _run_kind(Path(checkpoint)) == "flow":
        return export_adapter(checkpoint, out_dir, ema=ema)
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


def _run_kind(checkpoint: Path) -> str | None:
    """The ``kind`` of the run that saved ``checkpoint`` (its trainer state records the config); None if unknown."""
    import json

    try:
        saved = json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    config = saved.get("extra", {}).get("config") if isinstance(saved, dict) else None
    return config.get("kind") if isinstance(config, dict) else None


def ema_adapter_weights(average: dict, adapter: dict, adapter_name: str = "default") -> dict:
    """The moving average keyed as PEFT saves the adapter: a trained parameter's name without its adapter
    name (``...lora_A.default.weight`` -> ``...lora_A.weight``). ValueError unless the two name the same
    tensors with the same shapes."""
    renamed = {name.replace(f".{adapter_name}.", "."): value for name, value in average.items()}
    if renamed.keys() != adapter.keys():
        only_ema, only_adapter = sorted(renamed.keys() - adapter.keys()), sorted(adapter.keys() - renamed.keys())
        raise ValueError(f"the moving average and the adapter name different tensors: only averaged "
                         f"{only_ema[:3]}, only in the adapter {only_adapter[:3]}")
    shapes = [name for name, value in renamed.items() if tuple(value.shape) != tuple(adapter[name].shape)]
    if shapes:
        raise ValueError(f"the moving average and the adapter differ in shape at {shapes[:3]}")
    return renamed


def export_adapter(checkpoint: str | Path, out_dir: str | Path, *, ema: bool = False) -> Path:
    """Write the checkpoint's LoRA adapter (``adapter_config.json``, ``adapter_model.safetensors``) to
    ``out_dir`` atomically; with ``ema`` its weights are the checkpoint's moving average.

    The result loads with ``PeftModel.from_pretrained(transformer, out_dir)`` onto the base model's
    transformer. Other adapters a checkpoint holds (DiffusionNFT's sampling adapter in ``model/old/``)
    are not exported: the trained one is the policy.
    """
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir = Path(checkpoint) / "model"
    missing = [name for name in ADAPTER_FILES if not (model_dir / name).is_file()]
    if missing:
        raise ModelPathError(f"{checkpoint} holds no LoRA adapter ({', '.join(missing)} missing in {model_dir}): "
                             "only an adapter checkpoint exports as its adapter", str(checkpoint))
    weights = None
    if ema:
        if not (model_dir / EMA_FILE).is_file():
            raise ModelPathError(f"{checkpoint} holds no moving average ({model_dir / EMA_FILE}); it is written by "
                                 "runs with worker.actor.ema.enabled: true", str(checkpoint))
        adapter = load_file(str(model_dir / "adapter_model.safetensors"))
        try:
            weights = ema_adapter_weights(load_file(str(model_dir / EMA_FILE)), adapter)
        except ValueError as error:
            raise ModelPathError(f"{checkpoint}: {error}", str(checkpoint)) from None
        weights = {name: value.to(adapter[name].dtype).contiguous() for name, value in weights.items()}
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    shutil.copyfile(model_dir / "adapter_config.json", tmp / "adapter_config.json")
    if weights is None:
        shutil.copyfile(model_dir / "adapter_model.safetensors", tmp / "adapter_model.safetensors")
    else:
        save_file(weights, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt", "weights": "ema"})
    follow_umask(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
