"""Run under `torchrun --nproc_per_node 2`: the actor as `worker.actor.offload` builds it, inspected.

The policy is built by the trainer's own `setup_policy` from CONFIG (strategy fsdp, offload on), then
one forward, backward and AdamW step. The script records, on each process, the policy FSDP holds for
every unit (offload and mixed precision), where the parameter shards, their gradients and the optimizer
state live, and whether the step gave the same weights as the same model sharded without offload.
It writes `<out>/rank<r>.json`; tests/core/test_offload.py judges it.

    torchrun --nproc_per_node 2 tests/core/distributed/offload_check.py CONFIG OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a plain tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def one_step(model, optimizer, ids: torch.Tensor) -> None:
    logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    optimizer.step()


def main(config_path: str, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from grouprl.config import load_config
    from grouprl.trainer.parallel import full_named_parameters, shard_fsdp
    from grouprl.trainer.policy import build_optimizer, build_policy, setup_policy

    config = load_config(config_path)
    actor = config.worker.actor
    trained = setup_policy(actor, config.trainer)
    model, rank = trained.model, torch.distributed.get_rank()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = []
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 (FSDP2 exposes no public accessor)
        policies.append({"offload": type(group.offload_policy).__name__,
                         "pin_memory": getattr(group.offload_policy, "pin_memory", None),
                         "param_dtype": str(group.mp_policy.param_dtype)})
    plain, _, _ = build_policy(actor.model, trained.precision)
    plain = shard_fsdp(plain, trained.precision, trained.accelerator.device)
    optimizers = [build_optimizer(m, actor) for m in (model, plain)]
    ids = torch.randint(0, plain.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(rank))
    for m, optimizer in zip((model, plain), optimizers):
        one_step(m, optimizer, ids)
    states = [t for s in optimizers[0].state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    offloaded = dict(full_named_parameters(model))
    same = all(torch.equal(offloaded[n], p) for n, p in full_named_parameters(plain))
    result = {
        "world": torch.distributed.get_world_size(),
        "units": len(units),
        "policies": policies,
        "param_devices": sorted({local(p).device.type for p in model.parameters()}),
        "grad_devices": sorted({local(p.grad).device.type for p in model.parameters() if p.grad is not None}),
        "optimizer_state_devices": sorted({local(t).device.type for t in states}),
        "optimizer_states": len(states),
        "same_as_without_offload": same,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
