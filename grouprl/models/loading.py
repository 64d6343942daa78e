"""Loading policy and reference models with their processors; LoRA, freezing, image-token checks."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Iterator

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    PretrainedConfig,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from grouprl.errors import ModelPathError
from grouprl.data.sample import Sample
from grouprl.models.inputs import encode_sample, model_config, tokenizer_of, unwrap_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}

# Where the known vision-language architectures keep their vision encoder and the
# projector into the language model (transformers 5 nests them under ``model``).
VISION_TOWER_ATTRS = (
    "model.visual",
    "visual",
    "model.vision_tower",
    "vision_tower",
    "model.vision_model",
    "vision_model",
)
PROJECTOR_ATTRS = ("model.multi_modal_projector", "multi_modal_projector", "model.mm_projector", "mm_projector")


def resolve_dtype(dtype: str | torch.dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def checkpoint_dtype(path: str | Path, *, trust_remote_code: bool = False) -> torch.dtype | None:
    """The dtype a checkpoint's config says its weights are stored in (None when it does not say)."""
    config = _from_path(AutoConfig.from_pretrained, str(path), "config", trust_remote_code=trust_remote_code)
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def is_vision_language_config(config: PretrainedConfig) -> bool:
    """Whether the Auto classes treat this checkpoint as image-text-to-text."""
    if getattr(config, "vision_config", None) is not None:
        return True
    if getattr(config, "model_type", None) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return True
    auto_map = getattr(config, "auto_map", None) or {}
    return "AutoModelForImageTextToText" in auto_map or "AutoModelForVision2Seq" in auto_map


def _looks_local(path: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be a path.
    return os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1


def run_checkpoints(run_dir: Path) -> list[Path]:
    """The ``checkpoints/global_step_N`` directories of a run directory, oldest first."""
    found = [p for p in (run_dir / "checkpoints").glob("global_step_*") if p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.rpartition("_")[2]) if p.name.rpartition("_")[2].isdigit() else -1)


def not_a_model(path: str | Path) -> ModelPathError | None:
    """Why ``path`` cannot be a model directory (missing, a grouprl checkpoint or run directory, a
    directory without config.json), or None when it may be one (a directory with a config.json, or a hub id)."""
    path = str(path)
    local = Path(path).expanduser()
    if not local.exists():
        return ModelPathError(f"model path {path!r} does not exist", path) if _looks_local(path) else None
    if not local.is_dir() or (local / "config.json").exists():
        return None
    if (local / "model").is_dir():
        return ModelPathError(f"{path} is a grouprl checkpoint, not a model directory; export it first: "
                              f"grouprl export {path} --out merged/", path)
    checkpoints = run_checkpoints(local)
    if checkpoints:
        return ModelPathError(f"{path} is a grouprl run directory, not a model directory; export one of its "
                              f"checkpoints first: grouprl export {checkpoints[-1]} --out merged/", path)
    # every model grouprl loads is read through AutoConfig, which needs config.json
    held = sorted(p.name for p in local.iterdir())
    what = "it is empty" if not held else f"it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}"
    return ModelPathError(f"model path {path} has no config.json, so it is not a Hugging Face model directory "
                          f"({what})", path)


def _from_path(loader, path: str, what: str, **kwargs):
    """Call a ``from_pretrained`` and turn 'not here and hub unreachable' into one clear error."""
    local = Path(path).expanduser()
    problem = not_a_model(path)
    if problem is not None:
        raise problem
    try:
        return loader(str(local) if local.exists() else path, **kwargs)
    except (OSError, ValueError) as exc:
        # the first line of transformers' message says what is missing; the rest is advice about URLs
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, ValueError) and not local.exists():
            raise
        if local.exists():  # a ValueError too: a config.json transformers cannot read (no model_type)
            raise ModelPathError(f"could not load the {what} from {path!r}: {reason}", path) from exc
        raise ModelPathError(
            f"{path!r} is not a local directory, and the {what} is neither in the Hugging Face cache nor "
            f"reachable on the hub (offline, or no network): download it where there is a network "
            f"(hf download {path}) or set the model path to a local copy ({reason})", path) from exc


def load_model_and_processor(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
):
    """Load a causal LM or vision-language model and its processor through the Auto classes.

    Returns ``(model, processor, is_vlm)``: for a vision-language checkpoint an
    ``AutoModelForImageTextToText`` and an ``AutoProcessor``; otherwise an
    ``AutoModelForCausalLM`` and its ``AutoTokenizer`` (used as the processor).
    ``path`` is a local directory or a hub id.
    """
    path = str(path)
    torch_dtype = resolve_dtype(dtype)
    config = _from_path(AutoConfig.from_pretrained, path, "config", trust_remote_code=trust_remote_code)
    is_vlm = is_vision_language_config(config)
    kwargs = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if is_vlm:
        model = _from_path(AutoModelForImageTextToText.from_pretrained, path, "model", **kwargs)
        processor = _from_path(AutoProcessor.from_pretrained, path, "processor", trust_remote_code=trust_remote_code)
    else:
        model = _from_path(AutoModelForCausalLM.from_pretrained, path, "model", **kwargs)
        processor = _from_path(AutoTokenizer.from_pretrained, path, "tokenizer", trust_remote_code=trust_remote_code)
    tokenizer = tokenizer_of(processor)
    if tokenizer.pad_token is None:
        # Batched generation needs a pad id; EOS is what Qwen and Llama checkpoints use.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if gradient_checkpointing:
        # Non-reentrant checkpointing passes gradients to LoRA weights without
        # requiring the inputs to need grad (the reentrant variant silently gives none).
        checkpointing = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 renamed it
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpointing)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    return model, processor, is_vlm


def load_reference_model(
    path: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
):
    """A frozen copy of the model at ``path`` in eval mode, for KL against the starting policy.

    With LoRA there is no need for one: the policy with its adapters disabled
    is the reference (see ``reference_log_prob_context``).
    """
    model, _, _ = load_model_and_processor(
        path, dtype=dtype, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    model.requires_grad_(False)
    return model.eval()


def has_lora(model) -> bool:
    return hasattr(unwrap_model(model), "disable_adapter")


@contextlib.contextmanager
def reference_log_prob_context(model) -> Iterator[None]:
    """Run the LoRA policy as its own reference: adapters disabled inside the block."""
    base = unwrap_model(model)
    if not hasattr(base, "disable_adapter"):
        raise ValueError(
            f"{type(base).__name__} has no LoRA adapters to disable; without LoRA load a separate "
            "reference with load_reference_model(path)"
        )
    with base.disable_adapter():
        yield


def _transformers_model(model):
    base = unwrap_model(model)
    return base.get_base_model() if hasattr(base, "get_base_model") else base


def _get_attr_path(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_vision_tower(model) -> tuple[str, torch.nn.Module] | None:
    """``(qualified name, module)`` of the vision encoder, or None for a text model."""
    base = _transformers_model(model)
    for attr in VISION_TOWER_ATTRS:
        module = _get_attr_path(base, attr)
        if isinstance(module, torch.nn.Module):
            return attr, module
    return None


def _vision_prefixes(base) -> list[str]:
    prefixes = []
    for attr in VISION_TOWER_ATTRS + PROJECTOR_ATTRS:
        if isinstance(_get_attr_path(base, attr), torch.nn.Module):
            prefixes.append(attr)
    # "visual" and "model.visual" can both resolve through attribute forwarding;
    # only names that really appear in named_modules count for peft's matching.
    names = {name for name, _ in base.named_modules()}
    return [p for p in prefixes if p in names]


def _outside(name: str, prefixes: list[str]) -> bool:
    return not any(name == p or name.startswith(p + ".") for p in prefixes)


def apply_lora(
    model,
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
    exclude_vision: bool = True,
    adapter_dtype: torch.dtype | None = torch.float32,
):
    """Wrap ``model`` in a peft LoRA model; by default only the language model gets adapters.

    The adapters are held in ``adapter_dtype`` (fp32 by default, whatever the base's
    dtype: they are what the optimizer updates); None leaves them in the base's dtype.

    ``target_modules`` is ``"all-linear"`` (every linear layer but the output
    head) or a list of module-name suffixes such as ``["q_proj", "v_proj"]``.
    With ``exclude_vision`` the vision tower and the projector are left
    without adapters (and frozen, as everything outside the adapters is).
    """
    from peft import LoraConfig, get_peft_model

    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got rank={rank}")
    base = _transformers_model(model)
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    if target_modules != "all-linear" and (isinstance(target_modules, str) or not target_modules):
        raise ValueError(f"target_modules={target_modules!r}: use 'all-linear' or a non-empty list of module names")
    excluded = _vision_prefixes(base) if exclude_vision else []
    output = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    linear = {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output and _outside(name, excluded)
    }
    if target_modules == "all-linear":
        if not excluded:
            targets: str | list[str] = "all-linear"
        else:
            suffixes = sorted({name.rsplit(".", 1)[-1] for name in linear})
            targets = _target_regex(suffixes, excluded)
    else:
        available = sorted({name.rsplit(".", 1)[-1] for name in linear})
        names = [n for n, _ in base.named_modules() if _outside(n, excluded)]
        for target in target_modules:
            if not any(n == target or n.endswith("." + target) for n in names):
                raise ValueError(
                    f"LoRA target module {target!r} matches no module"
                    + (" outside the vision tower" if excluded else "")
                    + f"; linear layers available: {available[:20]}"
                )
        targets = _target_regex(list(target_modules), excluded) if excluded else list(target_modules)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config, autocast_adapter_dtype=False)
    if adapter_dtype is not None:
        for param in peft_model.parameters():
            if param.requires_grad:
                param.data = param.data.to(adapter_dtype)
    return peft_model


def _target_regex(suffixes: list[str], excluded: list[str]) -> str:
    # peft full-matches a string target against each module name; the lookahead
    # keeps the vision tower out even where its layers share names (proj, qkv).
    skip = "|".join(re.escape(p) for p in excluded)
    names = "|".join(re.escape(s) for s in suffixes)
    return rf"^(?!(?:{skip})\.)(?:.*\.)?(?:{names})$"


def freeze(model, *, freeze_vision_tower: bool = False, trainable_modules: list[str] | None = None) -> int:
    """Freeze parameters in place; returns the number of trainable parameters left.

    ``trainable_modules`` freezes everything except parameters whose name
    contains one of the given strings (each must match something).
    ``freeze_vision_tower`` then freezes the vision encoder; it is an error on
    a vision-language model whose encoder is not found, and a no-op on a text model.
    """
    base = unwrap_model(model)
    if trainable_modules:
        named = list(base.named_parameters())
        for pattern in trainable_modules:
            if not any(pattern in name for name, _ in named):
                sample = [name for name, _ in named[:8]]
                raise ValueError(
                    f"trainable module {pattern!r} matches no parameter name; parameter names look like {sample}"
                )
        for name, param in named:
            param.requires_grad_(any(pattern in name for pattern in trainable_modules))
    if freeze_vision_tower:
        found = find_vision_tower(base)
        if found is not None:
            found[1].requires_grad_(False)
        elif is_vision_language_config(model_config(base)):
            children = [name for name, _ in _transformers_model(base).named_children()]
            raise ValueError(
                f"freeze_vision_tower: no vision tower found on {type(base).__name__} "
                f"(looked for {list(VISION_TOWER_ATTRS)}; top-level modules are {children})"
            )
    return sum(p.numel() for p in base.parameters() if p.requires_grad)


def check_image_tokens(processor, model, sample: Sample) -> int:
    """Check that the processor writes as many image tokens as the vision tower yields features.

    Encodes ``sample``, counts the model's ``image_token_id`` in the ids and
    compares with ``sum(prod(image_grid_thw) // merge_size**2)``. A mismatch
    (tokenizer and model config disagreeing on the image token, or processor
    and vision tower on patch/merge sizes) otherwise surfaces as a shape error
    deep inside the first forward. Returns the number of image tokens.
    """
    config = model if isinstance(model, PretrainedConfig) else model_config(model)
    image_token_id = getattr(config, "image_token_id", None)
    if image_token_id is None:
        image_token_id = getattr(config, "image_token_index", None)
    if image_token_id is None:
        raise ValueError(f"{type(config).__name__} has no image_token_id; is this a vision-language model?")
    encoded = encode_sample(processor, sample)
    found = int((encoded["input_ids"] == image_token_id).sum())
    grid = encoded.get("image_grid_thw")
    if grid is None:
        # Models without a grid use a fixed number of tokens per image; all we
        # can check is that the images got placeholders at all.
        if sample.images and found == 0:
            raise ValueError(
                f"sample {sample.id}: the prompt holds no image token (id {image_token_id} from the model config) "
                f"for its {len(sample.images)} image(s); the processor and the model disagree on the image token"
            )
        return found
    merge = _merge_size(processor, config)
    expected = int((grid.prod(-1) // merge**2).sum())
    if found != expected:
        raise ValueError(
            f"sample {sample.id}: the prompt holds {found} image token(s) (id {image_token_id} from the model config) "
            f"but image_grid_thw={grid.tolist()} with merge_size={merge} implies {expected}; "
            f"processor image_token_id={getattr(processor, 'image_token_id', None)}. "
            "The processor and the model disagree on the image token or the patch/merge sizes."
        )
    return found


def _merge_size(processor, config) -> int:
    # The vision tower's merge size decides how many features come out, so it
    # wins over the processor's (which decided how many tokens went in).
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", None)
    if merge is None:
        merge = getattr(getattr(processor, "image_processor", None), "merge_size", None)
    if merge is None:
        raise ValueError("cannot tell the spatial merge size from the model config or the processor")
    return int(merge)
