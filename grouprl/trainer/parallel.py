"""How the trained policy is spread over processes: DDP through Accelerate, or FSDP2.

``ddp``: every process holds the whole model; Accelerate wraps it in
DistributedDataParallel, which averages gradients in the backward of the last
micro-batch of a mini-batch.

``fsdp``: parameters, gradients and optimizer state are sharded over the processes
with torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), one unit per decoder
layer / vision block (the model's ``_no_split_modules``) and one for the rest.
Accelerate's own FSDP plugin only engages on accelerators (its CPU state is always
``MULTI_CPU``, i.e. DDP), so grouprl applies FSDP2 itself; the same code then runs
on CPU processes (gloo) and GPUs (NCCL). Every forward and backward of a sharded
model is a collective: each process must run the same number of them, which the
trainer guarantees by giving every process the same number of rows, and by
sampling from a separate, unsharded rollout copy of the weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ContextManager

import torch

from grouprl.trainer.precision import Precision


def has_trainable_vision_tower(model) -> bool:
    """Whether a vision-language policy trains any vision parameter.

    Such a tower gets no gradient from a micro-batch of text-only rows, which DDP
    reports as "Expected to have finished reduction in the prior iteration" unless
    it looks for unused parameters.
    """
    from grouprl.models.loading import find_vision_tower

    found = find_vision_tower(model)
    return found is not None and any(p.requires_grad for p in found[1].parameters())


def is_sharded(model) -> bool:
    """Whether ``model`` has been sharded with FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard_fsdp(model, precision: Precision, device: torch.device):
    """Shard ``model`` in place with FSDP2 over all processes; returns it.

    Each module whose class is in ``model._no_split_modules`` (decoder layers, vision
    blocks) becomes its own unit, gathered only while it runs; the root holds the
    rest (embeddings, head). Mixed precision gathers parameters in the compute dtype
    and reduces gradients in fp32.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = torch.distributed.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    options = {"mesh": mesh}
    if precision.mixed:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    unit_names = set(getattr(model, "_no_split_modules", None) or [])
    if not unit_names:
        raise ValueError(f"{type(model).__name__} names no _no_split_modules; cannot choose FSDP units")
    units = [m for m in model.modules() if type(m).__name__ in unit_names]
    for module in units:
        fully_shard(module, **options)
    fully_shard(model, **options)
    return model


def gradient_sync(model, accelerator, enabled: bool) -> ContextManager:
    """Let this backward reduce gradients across processes (the last micro-batch) or not."""
    if enabled or accelerator.num_processes == 1:
        if is_sharded(model):
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if is_sharded(model):
        model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()
    return accelerator.no_sync(model)


def clip_grad_norm(model, accelerator, max_norm: float) -> float:
    """Clip gradients to ``max_norm`` (over all processes' shards) and return the norm before clipping."""
    params = [p for p in model.parameters() if p.grad is not None]
    if is_sharded(model):
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)
    return float(accelerator.clip_grad_norm_(params, max_norm))


def full_named_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter, one at a time, names as in the unwrapped model.

    For a sharded model each tensor is gathered from all processes as it is yielded
    (a collective: every process must consume the whole iterator), so at most one
    full parameter at a time is held beside the shards.
    """
    from grouprl.models.inputs import unwrap_model

    for name, param in unwrap_model(model).named_parameters():
        full = getattr(param, "full_tensor", None)
        yield name, (full() if full is not None else param).detach()


def full_state_dicts(model, optimizer) -> tuple[dict | None, dict]:
    """The whole model (sharded models only; else None) and optimizer state, on the main process.

    A collective for sharded models: every process must call it; the others get empty
    dicts. The optimizer state is keyed by parameter name (not by position), so it
    loads into a model sharded over any number of processes, or not at all.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options) if is_sharded(model) else None
    return model_state, get_optimizer_state_dict(model, optimizer, options=options)


def load_full_state_dicts(model, optimizer, model_state: dict | None, optimizer_state: dict | None) -> None:
    """Load whole (unsharded, name-keyed) state into ``model`` / ``optimizer``, sharding it as they are.

    Every process passes the whole state it read from disk.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True)
    if model_state is not None:
        set_model_state_dict(model, model_state, options=options)
    if optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=options)
