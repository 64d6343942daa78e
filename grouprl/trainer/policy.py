"""Building the trainable policy, its optimizer and its learning-rate schedule from the config."""

from __future__ import annotations

import math

import torch

from grouprl.config import ActorConfig, ConfigError, ModelConfig


def build_policy(model_cfg: ModelConfig):
    """Load the policy with its processor, then apply freezing and LoRA as configured.

    Returns ``(model, processor, is_vlm)``.
    """
    from grouprl.models.loading import apply_lora, freeze, load_model_and_processor

    if not model_cfg.model_path:
        raise ConfigError("config key 'worker.actor.model.model_path' is not set")
    if model_cfg.lora.rank > 0 and model_cfg.trainable_modules:
        # peft trains only the adapters and saves only them: named base modules would be
        # frozen again, or trained and then lost from every checkpoint
        raise ConfigError("'worker.actor.model.trainable_modules' cannot be combined with LoRA "
                          "('worker.actor.model.lora.rank' > 0) yet; use one or the other")
    model, processor, is_vlm = load_model_and_processor(
        model_cfg.model_path,
        dtype=model_cfg.dtype,
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
                           target_modules=targets, exclude_vision=not lora.include_vision)
    return model, processor, is_vlm


def trainable_parameters(model) -> list[torch.nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the policy has no trainable parameters: check freeze_vision_tower / trainable_modules / lora")
    return params


def build_optimizer(model, actor: ActorConfig) -> torch.optim.Optimizer:
    optim = actor.optim
    return torch.optim.AdamW(trainable_parameters(model), lr=optim.lr, betas=tuple(optim.betas),
                             weight_decay=optim.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, actor: ActorConfig, total_updates: int):
    """Warm-up then constant, linear or cosine decay to ``min_lr_ratio`` of the peak."""
    optim = actor.optim
    warmup = int(optim.lr_warmup_ratio * total_updates)
    floor = optim.min_lr_ratio

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        if optim.lr_scheduler_type == "constant":
            return 1.0
        progress = min(1.0, (update - warmup) / max(1, total_updates - warmup))
        if optim.lr_scheduler_type == "linear":
            return floor + (1 - floor) * (1 - progress)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
