"""Building the trainable policy in its precision, spread over the processes, with its optimizer and schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from grouprl.config import ActorConfig, ConfigError, ModelConfig, TrainerConfig
from grouprl.trainer.precision import Precision, precision_policy


def check_model_path(model_cfg: ModelConfig) -> None:
    """``worker.actor.model.model_path`` is set and may hold a model (not missing, not a grouprl
    checkpoint or run directory): a :class:`ConfigError` naming the key otherwise, before any loading."""
    from grouprl.models.loading import not_a_model

    if not model_cfg.model_path:
        raise ConfigError("config key 'worker.actor.model.model_path' is not set")
    problem = not_a_model(model_cfg.model_path)
    if problem is not None:
        raise ConfigError(f"config key 'worker.actor.model.model_path': {problem}") from problem


def run_precision(model_cfg: ModelConfig, strategy: str) -> Precision:
    """The run's precision policy; ``dtype: auto`` reads the checkpoint's dtype."""
    check_model_path(model_cfg)
    checkpoint = None
    if model_cfg.dtype == "auto":
        from grouprl.models.loading import checkpoint_dtype

        checkpoint = checkpoint_dtype(model_cfg.model_path, trust_remote_code=model_cfg.trust_remote_code)
    try:
        return precision_policy(model_cfg.dtype, strategy, lora=model_cfg.lora.rank > 0, checkpoint_dtype=checkpoint)
    except ValueError as exc:
        raise ConfigError(f"config keys 'worker.actor.model.dtype' / 'worker.actor.optim.strategy': {exc}") from exc


def build_policy(model_cfg: ModelConfig, precision: Precision | None = None):
    """Load the policy with its processor, then apply freezing and LoRA as configured.

    The weights are loaded in ``precision.load_dtype`` (fp32 masters for full
    fine-tuning, the compute dtype for a frozen LoRA base) and LoRA adapters are held
    in ``precision.param_dtype``. Returns ``(model, processor, is_vlm)``.
    """
    from grouprl.models.loading import apply_lora, freeze, load_model_and_processor

    check_model_path(model_cfg)
    if model_cfg.lora.rank > 0 and model_cfg.trainable_modules:
        # peft trains only the adapters and saves only them: named base modules would be
        # frozen again, or trained and then lost from every checkpoint
        raise ConfigError("'worker.actor.model.trainable_modules' cannot be combined with LoRA "
                          "('worker.actor.model.lora.rank' > 0) yet; use one or the other")
    precision = precision or run_precision(model_cfg, "adamw")
    model, processor, is_vlm = load_model_and_processor(
        model_cfg.model_path,
        dtype=precision.load_dtype,
        trust_remote_code=model_cfg.trust_remote_code,
        gradient_checkpointing=model_cfg.enable_gradient_checkpointing,
    )
    if model_cfg.freeze_vision_tower or model_cfg.trainable_modules:
        freeze(model, freeze_vision_tower=model_cfg.freeze_vision_tower,
               trainable_modules=model_cfg.trainable_modules or None)
    if model_cfg.lora.rank > 0:
        lora = model_cfg.lora
        targets = lora.target_modules[0] if lora.target_modules == ["all-linear"] else lora.target_modules
        model = apply_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=targets, exclude_vision=not lora.include_vision,
                           adapter_dtype=precision.param_dtype)
    return model, processor, is_vlm


@dataclass
class TrainedPolicy:
    """The policy as trained: ``model`` runs forward/backward (DDP- or FSDP-wrapped),
    ``policy`` is the plain module underneath (saving, LoRA switches)."""

    model: Any
    policy: Any
    processor: Any
    is_vlm: bool
    precision: Precision
    accelerator: Any
    sharded: bool


def setup_policy(actor: ActorConfig, trainer: TrainerConfig) -> TrainedPolicy:
    """Load the policy in the run's precision, start Accelerate, and spread the policy over the processes.

    The Accelerator is made after the model because DDP's settings depend on it: a
    vision tower that trains gets no gradient from text-only micro-batches, so DDP
    must look for unused parameters.
    """
    from accelerate.utils import DistributedDataParallelKwargs, DistributedType

    from grouprl.models.inputs import unwrap_model
    from grouprl.trainer.parallel import has_trainable_vision_tower, make_accelerator, shard_fsdp

    precision = run_precision(actor.model, actor.optim.strategy)
    model, processor, is_vlm = build_policy(actor.model, precision)
    find_unused = is_vlm and has_trainable_vision_tower(model)
    accelerator = make_accelerator(trainer, [DistributedDataParallelKwargs(find_unused_parameters=find_unused)],
                                   offload=actor.strategy == "fsdp" and actor.offload.enabled)
    if trainer.device == "cuda" and accelerator.device.type != "cuda":
        raise ConfigError("config key 'trainer.device' is cuda but no CUDA device is available")
    sharded = actor.strategy == "fsdp"
    if accelerator.distributed_type == DistributedType.FSDP and not sharded:
        # Accelerate would shard the policy its own way, which the rollout path knows nothing of
        raise ConfigError("the launcher asked Accelerate for FSDP; set 'worker.actor.strategy: fsdp' instead "
                          "(grouprl shards the policy with FSDP2 itself) and launch without --use_fsdp")
    if sharded:
        if not torch.distributed.is_initialized():
            raise ConfigError("config key 'worker.actor.strategy': fsdp needs a distributed launch "
                              "(torchrun --nproc_per_node N -m grouprl train ...)")
        # sharded from host memory: each unit moves to the device as it is sharded, so no
        # process ever holds the whole model there
        model = shard_fsdp(model, precision, accelerator.device, offload=actor.offload.enabled)
    else:
        model = accelerator.prepare(model)
    return TrainedPolicy(model=model, policy=unwrap_model(model), processor=processor, is_vlm=is_vlm,
                         precision=precision, accelerator=accelerator, sharded=sharded)


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the policy has no trainable parameters: check freeze_vision_tower / trainable_modules / lora")
    return params


def build_optimizer(model, actor: ActorConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; its state takes their dtype (see ``precision``)."""
    optim = actor.optim
    return torch.optim.AdamW(trainable_parameters(model), lr=optim.lr, betas=tuple(optim.betas),
                             weight_decay=optim.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, actor: ActorConfig, total_steps: int):
    """Warm-up then constant, linear or cosine decay to ``min_lr_ratio`` of the peak.

    The schedule counts training steps, as verl and EasyR1 do: the trainer steps it
    once per training step, so it ends with the run whatever number of optimizer
    steps dynamic sampling or a short batch leaves a step, and every optimizer step of
    one training step uses that step's rate. Step s (from 0) gets factor(s); the last
    step of a decaying schedule gets the floor.
    """
    optim = actor.optim
    warmup = int(optim.lr_warmup_ratio * total_steps)
    floor = optim.min_lr_ratio
    decay_steps = max(1, total_steps - warmup - 1)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / decay_steps)
        if optim.lr_scheduler_type == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
