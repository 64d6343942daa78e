"""`grouprl plan CONFIG [key=value ...] [--gpus N] [--gpu-memory GiB] [--json]`: a step's memory before any GPU work.

Reads the run config and the model's config (no weights: ``grouprl.planning.model_shape``), prints
the peak memory per device part by part and phase by phase (``grouprl.planning.plan``), whether it
fits the device, and when it does not, the cheapest changes that make it fit, each re-planned.

``--json`` prints one object (the keys are listed in docs/scaling.md#planning-memory):
``model``, ``gpus``, ``gpu_memory_bytes``, ``parts`` (bytes per part), ``phases`` (bytes per
part in each phase), ``phase_totals``, ``peak_bytes``, ``peak_phase``, ``fits`` (null without
a device size), ``tokens_per_step``, ``images_per_step``, ``image_tokens_per_image``,
``kv_cache``, ``suggestions`` (``change``, ``overrides``, ``peak_bytes``, ``fits``), ``notes``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

from grouprl.cli import Command, UsageError, _config_arguments

PART_NAMES = {
    "weights": "trained weights (+ frozen base)",
    "optimizer_state": "AdamW state",
    "gradients": "gradients",
    "autocast_weight_copies": "bf16 weight copies (autocast)",
    "activations": "activations (largest micro-batch)",
    "checkpoint_recompute": "one layer recomputed (checkpointing)",
    "logprob_chunk": "log-prob chunk (update)",
    "logprob_chunk_experience": "log-prob chunk (no-grad forwards)",
    "reference": "reference model",
    "rollout_copy": "rollout copy",
    "teacher": "teacher",
    "vllm": "vLLM (weights + KV cache)",
    "generation_kv_cache": "generation KV cache (hf engine)",
}


def _arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    p.add_argument("--gpus", default="1", help="devices the run uses (FSDP shards over them), default 1")
    p.add_argument("--gpu-memory", default=None, metavar="GiB",
                   help="memory of one device in GiB (default: the visible GPU's; without a GPU no verdict)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of the table")


def _positive(value: str, flag: str, kind=int):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise UsageError(f"{flag} must be a positive number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise UsageError(f"{flag} must be a positive number, got {value!r}")
    return number


def _gpu_memory(value: str | None) -> int | None:
    if value is not None:
        return int(_positive(value, "--gpu-memory", float) * 2**30)
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    return None


def build_plan(config, *, gpus: int, gpu_memory: int | None) -> dict:
    """The plan of ``config`` as the JSON object ``--json`` prints."""
    from grouprl.config import ConfigError
    from grouprl.errors import ModelPathError
    from grouprl.planning.model_shape import image_tokens_per_image, model_shape
    from grouprl.planning.plan import plan_memory, settings_from_config, suggestions

    model = config.worker.actor.model
    if not model.model_path:
        raise ConfigError("config key 'worker.actor.model.model_path' is not set: the plan needs the model's config")

    def shape(lora_rank: int):
        try:
            return model_shape(model.model_path, trust_remote_code=model.trust_remote_code, lora_rank=lora_rank,
                               lora_alpha=model.lora.alpha if lora_rank == model.lora.rank else 2 * lora_rank,
                               lora_targets=model.lora.target_modules if model.lora.target_modules != ["all-linear"]
                               else "all-linear", lora_include_vision=model.lora.include_vision,
                               freeze_vision_tower=model.freeze_vision_tower,
                               trainable_modules=model.trainable_modules)
        except ModelPathError as exc:
            raise ConfigError(f"config key 'worker.actor.model.model_path' = {model.model_path!r}: "
                              f"cannot read the model's config ({exc})") from None

    actor_shape = shape(model.lora.rank)
    teacher_parameters = 0
    teacher = config.algorithm.teacher
    if teacher.model_path:
        try:
            teacher_parameters = model_shape(teacher.model_path, trust_remote_code=teacher.trust_remote_code).parameters
        except ModelPathError as exc:
            raise ConfigError(f"config key 'algorithm.teacher.model_path' = {teacher.model_path!r}: "
                              f"cannot read the model's config ({exc})") from None
    settings = settings_from_config(config, gpus=gpus, teacher_parameters=teacher_parameters)
    image_tokens = (image_tokens_per_image(model.model_path, max_pixels=config.data.max_pixels,
                                           trust_remote_code=model.trust_remote_code)
                    if actor_shape.is_vlm else None)
    plan = plan_memory(actor_shape, settings, gpu_memory, image_tokens_per_image=image_tokens)
    advice = suggestions(actor_shape, settings, gpu_memory, shape, image_tokens=image_tokens) \
        if plan.fits is False else []
    notes = list(plan.notes)
    if gpu_memory is None:
        notes.append("no GPU visible and no --gpu-memory: no verdict on whether it fits")
    return {
        "model": dataclasses.asdict(actor_shape), "gpus": gpus, "gpu_memory_bytes": gpu_memory,
        "settings": dataclasses.asdict(settings), "parts": plan.parts, "phases": plan.phases,
        "phase_totals": plan.phase_totals, "peak_bytes": plan.peak, "peak_phase": plan.peak_phase, "fits": plan.fits,
        "tokens_per_step": plan.tokens_per_step, "images_per_step": plan.images_per_step,
        "image_tokens_per_image": plan.image_tokens_per_image, "kv_cache": plan.kv_cache,
        "suggestions": [{"change": s.change, "overrides": s.overrides, "peak_bytes": s.peak, "fits": s.fits}
                        for s in advice],
        "notes": notes,
    }


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def render(result: dict) -> None:
    """The plan as rich tables on stdout."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    m = result["model"]
    console.print(f"[bold]{m['path']}[/] ({m['model_type']}{', vision-language' if m['is_vlm'] else ''}): "
                  f"{m['parameters'] / 1e9:.3f}B parameters, {m['trained_parameters'] / 1e6:,.1f}M trained; "
                  f"{result['gpus']} GPU(s), {result['settings']['dtype']}, "
                  f"strategy {'fsdp' if result['settings']['sharded'] else 'ddp'}")
    table = Table(title="memory per device (GiB)")
    table.add_column("part")
    for phase in result["phases"]:
        table.add_column(phase, justify="right")
    for part, label in PART_NAMES.items():
        if part not in result["parts"]:
            continue
        cells = [_gib(result["phases"][p][part]) if part in result["phases"][p] else "" for p in result["phases"]]
        if any(c not in ("", "0.00") for c in cells):
            table.add_row(label, *cells)
    table.add_row("[bold]total[/]", *[f"[bold]{_gib(v)}[/]" for v in result["phase_totals"].values()])
    console.print(table)
    verdict = {True: "[green]fits[/]", False: "[red]does not fit[/]", None: "no verdict"}[result["fits"]]
    console.print(f"peak {_gib(result['peak_bytes'])} GiB ({result['peak_phase']}) of "
                  f"{_gib(result['gpu_memory_bytes'])} GiB: {verdict}")
    console.print(f"tokens per step {result['tokens_per_step']:,}, images per step {result['images_per_step']:,}"
                  + (f", image tokens per image <= {result['image_tokens_per_image']:,}"
                     if result["image_tokens_per_image"] else ""))
    if result["suggestions"]:
        advice = Table(title="changes that lower the peak (each re-planned)")
        advice.add_column("change")
        advice.add_column("overrides", overflow="fold")
        advice.add_column("peak GiB", justify="right")
        advice.add_column("fits")
        for s in result["suggestions"]:
            advice.add_row(s["change"], " ".join(s["overrides"]), _gib(s["peak_bytes"]),
                           {True: "yes", False: "no", None: "-"}[s["fits"]])
        console.print(advice)
    for note in result["notes"]:
        console.print(f"note: {note}")


def cmd_plan(args) -> int:
    from grouprl.config import load_config

    gpus = _positive(args.gpus, "--gpus")
    gpu_memory = _gpu_memory(args.gpu_memory)
    config = load_config(args.config, args.overrides)
    result = build_plan(config, gpus=gpus, gpu_memory=gpu_memory)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        render(result)
    return 0


PLAN = Command("the peak memory per device of a run's step, part by part, before any GPU work (no weights "
               "loaded); what to change when it does not fit", cmd_plan, _arguments)
