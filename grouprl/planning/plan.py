"""The memory plan of a run: its settings read from the config, the parts per device, the phases, the verdict.

``settings_from_config(config, gpus=N)`` reads what memory depends on; ``plan_memory(shape, settings,
gpu_memory)`` adds up ``grouprl.planning.memory``'s parts for one device in each phase of a step and
takes the largest:

- generation: the training state at rest (weights, optimizer state), the frozen copies (reference,
  rollout copy, teacher) and the engine (vLLM's share of the device; the hf engines' KV cache);
- experience: the no-grad log-prob forwards (one chunk of the output layer at a time);
- update: the training state, the gradients, one micro-batch's activations (and with checkpointing
  one layer recomputed), the log-prob chunk with its backward; vLLM's share unless it sleeps
  (``worker.rollout.enable_sleep_mode``), the reference and the teacher unless offloaded.

``suggestions(...)`` re-plans the run with each cheap change applied (checkpointing, a smaller
micro-batch, fewer sequences generated at once, vLLM's share cut to what a step's sequences need, CPU
offload, LoRA, more GPUs under FSDP): every figure
is a plan, not a percentage; a change that does not lower the peak is left out.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from grouprl.planning import memory
from grouprl.planning.model_shape import ModelShape

_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass(frozen=True)
class RunSettings:
    """What a step's memory depends on, read from the config (``settings_from_config``)."""

    gpus: int = 1
    sharded: bool = False  # worker.actor.strategy == fsdp
    dtype: str = "float32"  # worker.actor.model.dtype
    optim_strategy: str = "adamw"  # worker.actor.optim.strategy
    lora_rank: int = 0
    lora_alpha: float = 16
    checkpointing: bool = False
    micro_batch_update: int = 4
    micro_batch_experience: int = 16
    padding_free: bool = False
    prompt_length: int = 1024
    response_length: int = 512
    rollout_batch_size: int = 8
    n: int = 5
    chunk_tokens: int = 1024
    reference: bool = False  # a separate reference model (grpo.reference_model_needed)
    engine: str = "hf"
    engine_owns_weights: bool = False
    async_mode: str = "sync"
    rollout_micro_batch: int | None = None
    gpu_memory_utilization: float = 0.6
    sleep_mode: bool = True
    offload: bool = False  # the actor's parameters, gradients and AdamW state in host memory
    ref_offload: bool = False
    teacher_parameters: int = 0
    teacher_bytes: int = 2
    teacher_offload: bool = False
    images_per_prompt: int = 0
    entropy_grad: bool = False


def settings_from_config(config, *, gpus: int = 1, teacher_parameters: int = 0) -> RunSettings:
    """The run settings of ``config`` (a grouprl ``Config``) on ``gpus`` devices."""
    from grouprl.rollout.engine import engine_class
    from grouprl.rollout.multiturn import run_response_budget
    from grouprl.trainer.grpo import reference_model_needed

    actor, roll, data = config.worker.actor, config.worker.rollout, config.data
    teacher = config.algorithm.teacher
    return RunSettings(
        gpus=gpus, sharded=actor.strategy == "fsdp", dtype=actor.model.dtype, optim_strategy=actor.optim.strategy,
        lora_rank=actor.model.lora.rank, lora_alpha=actor.model.lora.alpha,
        checkpointing=actor.model.enable_gradient_checkpointing,
        micro_batch_update=actor.micro_batch_size_per_device_for_update,
        micro_batch_experience=actor.micro_batch_size_per_device_for_experience, padding_free=actor.padding_free,
        # a multi-turn rollout's response is its whole dialogue: turns and what came between them
        prompt_length=data.max_prompt_length, response_length=run_response_budget(config),
        rollout_batch_size=data.rollout_batch_size, n=roll.n, chunk_tokens=actor.log_prob_chunk_tokens,
        reference=reference_model_needed(config), engine=roll.engine,
        engine_owns_weights=engine_class(roll.engine).owns_weights, async_mode=config.trainer.async_mode,
        rollout_micro_batch=roll.micro_batch_size, gpu_memory_utilization=roll.gpu_memory_utilization,
        sleep_mode=roll.enable_sleep_mode,
        # either key turns on FSDP2's CPUOffloadPolicy, which moves parameters, gradients and AdamW state
        # together (grouprl.trainer.parallel.offload_policy)
        offload=actor.offload.enabled,
        ref_offload=config.worker.ref.offload.offload_params,
        teacher_parameters=teacher_parameters,
        teacher_bytes=4 if teacher.dtype == "float32" else 2, teacher_offload=teacher.offload,
        images_per_prompt=(roll.limit_images or 1), entropy_grad=actor.entropy_coeff != 0)


@dataclass
class MemoryPlan:
    """One device's memory in each phase of a step, part by part (bytes)."""

    parts: dict[str, int]
    phases: dict[str, dict[str, int]]
    gpu_memory: int | None
    tokens_per_step: int
    images_per_step: int
    image_tokens_per_image: int | None
    kv_cache: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def phase_totals(self) -> dict[str, int]:
        return {name: sum(parts.values()) for name, parts in self.phases.items()}

    @property
    def peak(self) -> int:
        return max(self.phase_totals.values())

    @property
    def peak_phase(self) -> str:
        totals = self.phase_totals
        return max(totals, key=totals.get)

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.peak <= self.gpu_memory


def precision_bytes(settings: RunSettings, shape: ModelShape) -> tuple[int, int, int, bool]:
    """``(param, compute, frozen, rollout_copy)`` of the run's precision (``grouprl.trainer.precision``)."""
    from grouprl.trainer.precision import precision_policy

    checkpoint = getattr(torch, shape.checkpoint_dtype, None) if shape.checkpoint_dtype else None
    p = precision_policy(settings.dtype, settings.optim_strategy, lora=settings.lora_rank > 0,
                         checkpoint_dtype=checkpoint if isinstance(checkpoint, torch.dtype) else None)
    return _BYTES[p.param_dtype], _BYTES[p.compute_dtype], _BYTES[p.frozen_dtype], p.rollout_copy


def plan_memory(shape: ModelShape, settings: RunSettings, gpu_memory: int | None, *,
                image_tokens_per_image: int | None = None) -> MemoryPlan:
    """The per-device memory of ``settings`` for a model of ``shape`` (see the module docstring)."""
    from grouprl.trainer.grpo import rollout_weights

    param_b, compute_b, frozen_b, precision_copy = precision_bytes(settings, shape)
    lora = settings.lora_rank > 0
    shards = settings.gpus if settings.sharded else 1
    notes: list[str] = []
    # trained weights (LoRA: the bf16 base and the fp32 adapters)
    if lora:
        weights = (memory.weights_bytes(shape.parameters, frozen_b, shards)
                   + memory.weights_bytes(shape.adapter_parameters, 4, shards))
        trained, state_b, grad_b = shape.adapter_parameters, 4, 4
    else:
        frozen_part = shape.parameters - shape.trained_parameters  # a frozen vision tower stays in the load dtype
        weights = memory.weights_bytes(shape.trained_parameters, param_b, shards) + memory.weights_bytes(
            frozen_part, param_b, shards)
        trained, state_b, grad_b = shape.trained_parameters, param_b, param_b
    optimizer = memory.adamw_state_bytes(trained, state_b, shards)
    grads = memory.gradient_bytes(trained, grad_b, shards)
    if settings.offload:
        weights, grads, optimizer = 0, 0, 0
        notes.append("offload: parameters, gradients and AdamW state on the host; one layer at a time on the device")
    reference = memory.weights_bytes(shape.parameters, frozen_b) if settings.reference else 0
    _, copy_here = rollout_weights(settings.engine_owns_weights, precision_copy, sharded=settings.sharded,
                                   async_mode=settings.async_mode)
    rollout_copy = memory.weights_bytes(shape.parameters, frozen_b) if copy_here else 0
    teacher = settings.teacher_parameters * settings.teacher_bytes
    mixed = compute_b != param_b and not lora
    autocast_copies = memory.autocast_copy_bytes(shape.linear_parameters, mixed=mixed, sharded=settings.sharded)

    seq = settings.prompt_length + settings.response_length
    rows = settings.micro_batch_update
    tokens = rows * seq
    # sdpa gets a mask either way: the padded batch's [rows, 1, S, S], or the packed row's [1, 1, T, T]
    # (transformers separates packed sequences by masking them from each other)
    masked = True
    mask_elements = tokens * tokens if settings.padding_free else rows * seq * seq
    residual_b = param_b if not lora else frozen_b
    layer = dict(hidden=shape.hidden, kv_dim=shape.kv_dim, intermediate=shape.intermediate, heads=shape.heads,
                 residual_bytes=residual_b, compute_bytes=compute_b, masked=masked,
                 grouped=shape.heads > shape.kv_heads, mask_elements=mask_elements)
    activations = memory.activation_bytes(tokens, layers=shape.layers, checkpointing=settings.checkpointing, **layer)
    recompute = memory.recompute_bytes(tokens, checkpointing=settings.checkpointing, **layer)
    positions = rows * settings.response_length
    chunk_update = (memory.logprob_chunk_bytes(positions, shape.vocab, settings.chunk_tokens, compute_bytes=compute_b,
                                               with_entropy=True, backward=True)
                    + memory.unchunked_logits_bytes(positions, shape.vocab, settings.chunk_tokens))
    chunk_experience = memory.logprob_chunk_bytes(settings.micro_batch_experience * settings.response_length,
                                                  shape.vocab, settings.chunk_tokens, compute_bytes=compute_b,
                                                  with_entropy=False, backward=False)

    sequences = -(-settings.rollout_batch_size * settings.n // settings.gpus)  # per device
    kv_token = memory.kv_cache_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, frozen_b)
    engine: dict[str, int] = {}
    kv_cache = {"bytes_per_token": kv_token, "tokens_needed": sequences * seq}
    if settings.engine == "vllm":
        if gpu_memory is None:
            notes.append("vLLM's share needs the device memory (--gpu-memory): not counted")
        else:
            engine["vllm"] = memory.vllm_bytes(gpu_memory, settings.gpu_memory_utilization)
            kv_cache["tokens_held"] = memory.vllm_kv_tokens(gpu_memory, settings.gpu_memory_utilization,
                                                            memory.weights_bytes(shape.parameters, frozen_b), kv_token)
            if kv_cache["tokens_held"] < kv_cache["tokens_needed"]:
                notes.append(f"vLLM's KV cache holds {kv_cache['tokens_held']:,} of the {kv_cache['tokens_needed']:,} "
                             "tokens of a step's sequences: it generates them in turns (slower, not out of memory)")
    else:
        generating = settings.rollout_micro_batch or sequences
        engine["generation_kv_cache"] = min(generating, sequences) * seq * kv_token

    parts = {"weights": weights, "optimizer_state": optimizer, "gradients": grads,
             "autocast_weight_copies": autocast_copies, "activations": activations,
             "checkpoint_recompute": recompute, "logprob_chunk": chunk_update,
             "logprob_chunk_experience": chunk_experience, "reference": reference, "rollout_copy": rollout_copy,
             "teacher": teacher, **engine}
    at_rest = {"weights": weights, "optimizer_state": optimizer, "reference": reference,
               "rollout_copy": rollout_copy, "teacher": teacher}
    engine_during_update = {} if settings.sleep_mode and settings.engine == "vllm" else (
        {"vllm": engine["vllm"]} if "vllm" in engine else {})
    phases = {
        "generation": {**at_rest, **engine},
        "experience": {**at_rest, **engine_during_update, "logprob_chunk_experience": chunk_experience},
        "update": {**at_rest, **engine_during_update, "gradients": grads,
                   "autocast_weight_copies": autocast_copies, "activations": activations,
                   "checkpoint_recompute": recompute, "logprob_chunk": chunk_update},
    }
    if settings.ref_offload:
        phases["update"]["reference"] = 0
        phases["generation"]["reference"] = 0
    if settings.teacher_offload:
        phases["update"]["teacher"] = 0
        phases["generation"]["teacher"] = 0
    images = settings.images_per_prompt if shape.is_vlm else 0
    return MemoryPlan(parts=parts, phases=phases, gpu_memory=gpu_memory,
                      tokens_per_step=settings.rollout_batch_size * settings.n * seq,
                      images_per_step=settings.rollout_batch_size * settings.n * images,
                      image_tokens_per_image=image_tokens_per_image, kv_cache=kv_cache, notes=notes)


@dataclass(frozen=True)
class Suggestion:
    """A change that lowers the peak: the config overrides (and ``--gpus``) and the plan with it applied."""

    change: str
    overrides: list[str]
    peak: int
    fits: bool | None


def suggestions(shape: ModelShape, settings: RunSettings, gpu_memory: int | None,
                shape_with_lora: Callable[[int], ModelShape], *, image_tokens: int | None = None) -> list[Suggestion]:
    """Each cheap change re-planned, cheapest first; then, when none fits alone, the changes added up in order."""
    def peak(s: RunSettings, sh: ModelShape = shape) -> MemoryPlan:
        return plan_memory(sh, s, gpu_memory, image_tokens_per_image=image_tokens)

    candidates: list[tuple[str, list[str], RunSettings, ModelShape]] = []
    if not settings.checkpointing:
        candidates.append(("gradient checkpointing", ["worker.actor.model.enable_gradient_checkpointing=true"],
                           dataclasses.replace(settings, checkpointing=True), shape))
    rows = settings.micro_batch_update
    while rows > 1:
        rows //= 2
        s = dataclasses.replace(settings, micro_batch_update=rows)
        if rows == 1 or peak(s).fits:
            candidates.append((f"micro-batch {rows}", [f"worker.actor.micro_batch_size_per_device_for_update={rows}"],
                               s, shape))
            break
    if settings.engine == "vllm" and gpu_memory:
        # vLLM's share need only hold its bf16 weights and the KV cache of a step's sequences (rounded up
        # to 0.05); more only lets it batch more at once
        _, _, frozen_b, _ = precision_bytes(settings, shape)
        sequences = -(-settings.rollout_batch_size * settings.n // settings.gpus)
        need = (memory.weights_bytes(shape.parameters, frozen_b) + sequences * (settings.prompt_length
                + settings.response_length) * memory.kv_cache_bytes_per_token(shape.layers, shape.kv_heads,
                                                                               shape.head_dim, frozen_b))
        share = math.ceil(20 * need / gpu_memory) / 20
        if share < settings.gpu_memory_utilization:
            candidates.append((f"vLLM's share {share:.2f}", [f"worker.rollout.gpu_memory_utilization={share:.2f}"],
                               dataclasses.replace(settings, gpu_memory_utilization=share), shape))
    if settings.engine != "vllm":
        # the hf engines' KV cache grows with the sequences generated at once
        sequences = -(-settings.rollout_batch_size * settings.n // settings.gpus)
        at_once = min(settings.rollout_micro_batch or sequences, sequences)
        while at_once > 1:
            at_once //= 2
            s = dataclasses.replace(settings, rollout_micro_batch=at_once)
            if at_once == 1 or peak(s).fits:
                candidates.append((f"generate {at_once} sequences at a time",
                                   [f"worker.rollout.micro_batch_size={at_once}"], s, shape))
                break
    if settings.reference and not settings.ref_offload:
        candidates.append(("offload the reference model", ["worker.ref.offload.offload_params=true"],
                           dataclasses.replace(settings, ref_offload=True), shape))
    if not settings.offload and settings.lora_rank == 0:
        # FSDP2's CPUOffloadPolicy: needs the fsdp strategy, which LoRA cannot use
        candidates.append(("offload parameters and optimizer state",
                           ([] if settings.sharded else ["worker.actor.strategy=fsdp"])
                           + ["worker.actor.offload.offload_params=true"],
                           dataclasses.replace(settings, sharded=True, offload=True),
                           shape))
    if settings.lora_rank == 0 and not settings.sharded:  # FSDP with LoRA is refused
        lora = dataclasses.replace(settings, lora_rank=64, lora_alpha=128, reference=False)
        candidates.append(("LoRA rank 64", ["worker.actor.model.lora.rank=64", "worker.actor.model.lora.alpha=128"],
                           lora, shape_with_lora(64)))
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus <= settings.gpus:
            continue
        # with LoRA (which FSDP refuses) more processes only split the step's sequences
        shard = settings.lora_rank == 0
        s = dataclasses.replace(settings, gpus=gpus, sharded=settings.sharded or shard)
        if gpus == 64 or peak(s).fits:
            candidates.append((f"FSDP over {gpus} GPUs" if shard else f"{gpus} GPUs (data parallel)",
                               (["worker.actor.strategy=fsdp"] if shard and not settings.sharded else [])
                               + [f"--gpus {gpus}"], s, shape))
            break
    base = peak(settings).peak
    # a change that does not lower the peak (it acts on another phase) is no advice
    candidates = [c for c in candidates if peak(c[2], c[3]).peak < base]
    out = [Suggestion(name, overrides, peak(s, sh).peak, peak(s, sh).fits) for name, overrides, s, sh in candidates]
    if gpu_memory is not None and not any(x.fits for x in out):
        # none alone: add them up in order until the plan fits
        combined, sh, names, overrides = settings, shape, [], []
        for name, extra, s, shape_s in candidates:
            changed = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)
                       if getattr(s, f.name) != getattr(settings, f.name)}
            if (changed.get("sharded") and combined.lora_rank) or (changed.get("lora_rank") and combined.sharded):
                continue  # FSDP (and offload through it) and LoRA do not go together
            combined = dataclasses.replace(combined, **changed)
            sh = shape_s if shape_s is not shape else sh
            names.append(name)
            overrides += [o for o in extra if o not in overrides]
            result = peak(combined, sh)
            if result.fits:
                out.append(Suggestion(" + ".join(names), overrides, result.peak, True))
                break
    return out
