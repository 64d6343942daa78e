"""Run under `torchrun --nproc_per_node 2`: a training run with `worker.actor.offload`, then its actor inspected.

The run is what `grouprl train CONFIG OVERRIDES...` does (the trainer built from the config, trained,
checkpoints saved). Then the script records, on each process, the policy FSDP holds for every unit
(offload and mixed precision), where the parameter shards, the gradients of one more backward and the
optimizer state live, and whether one AdamW step of a freshly sharded model with offload gives the
same weights as the same model sharded without. It writes `<out>/rank<r>.json`;
tests/core/test_offload.py judges it.

    torchrun --nproc_per_node 2 tests/core/distributed/offload_check.py OUT_DIR CONFIG [OVERRIDES...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor (a plain tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def backward(model, ids: torch.Tensor) -> None:
    model(input_ids=ids).logits.float().logsumexp(-1).mean().backward()


def same_step_without_offload(actor, precision, device, ids: torch.Tensor) -> bool:
    """One AdamW step of the policy sharded with offload and without: the same weights after it."""
    from grouprl.trainer.parallel import full_named_parameters, shard_fsdp
    from grouprl.trainer.policy import build_optimizer, build_policy

    weights = []
    for offload in (True, False):
        model = shard_fsdp(build_policy(actor.model, precision)[0], precision, device, offload=offload)
        optimizer = build_optimizer(model, actor)
        backward(model, ids)
        optimizer.step()
        weights.append(dict(full_named_parameters(model)))
    return weights[0].keys() == weights[1].keys() and all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())


def main(out: str, config_path: str, *overrides: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from grouprl.config import read_config_values
    from grouprl.trainer.kinds import trainer_kind

    values = read_config_values(config_path, list(overrides))
    config, trainer = trainer_kind(values).build(values)  # as `grouprl train` builds it
    trainer.train()
    model, rank = trainer.model, torch.distributed.get_rank()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    policies = []
    for unit in units:
        group = unit._get_fsdp_state()._fsdp_param_group  # noqa: SLF001 (FSDP2 exposes no public accessor)
        policies.append({"offload": type(group.offload_policy).__name__,
                         "pin_memory": getattr(group.offload_policy, "pin_memory", None),
                         "param_dtype": str(group.mp_policy.param_dtype)})
    states = [t for s in trainer.optimizer.state.values() for t in s.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]  # AdamW's moments (not its step counts)
    ids = torch.randint(0, trainer.policy.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(rank))
    backward(model, ids)
    result = {
        "world": torch.distributed.get_world_size(),
        "units": len(units),
        "policies": policies,
        "param_devices": sorted({local(p).device.type for p in model.parameters()}),
        "grad_devices": sorted({local(p.grad).device.type for p in model.parameters() if p.grad is not None}),
        "optimizer_state_devices": sorted({local(t).device.type for t in states}),
        "optimizer_states": len(states),
        "same_as_without_offload": same_step_without_offload(config.worker.actor, trainer.precision,
                                                             trainer.accelerator.device, ids),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
