"""What the two-process vLLM scripts (fsdp_weight_sync.py, tensor_parallel.py) share: their prompts, the
seeded noise both apply to an FSDP2 policy and a plain copy, and how they compare log-probs.

Imported by the scripts as a sibling module (torchrun puts a script's directory first on sys.path).
"""

from __future__ import annotations

import torch

PROMPTS = [  # two per process: each process asks for its own
    "Heart size is normal.",
    "Mild cardiomegaly.",
    "No acute cardiopulmonary process.",
    "Describe the picture.",
]
NOISE_SEED = 1234
NOISE_SCALE = 0.05  # the tiny model's weights are ~N(0, 0.02): log-probs move by far more than the tolerance


def diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> dict:
    """Max and mean |a - b| over the response tokens (``mask``)."""
    d = (a.float() - b.float()).abs()[mask.bool()]
    return {"max": float(d.max()), "mean": float(d.mean()), "tokens": int(d.numel())}


def rows(batch) -> list[list[int]]:
    """Each response's token ids, without padding."""
    return [row[: int(m.sum())].tolist() for row, m in zip(batch.response_ids, batch.response_mask)]


@torch.no_grad()
def perturb_alike(sharded: torch.nn.Module, plain: torch.nn.Module) -> None:
    """The same seeded noise (the same on every process) added to ``sharded``'s FSDP2 shards and to ``plain``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(NOISE_SEED)
    plain_params = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        noise = torch.randn(tuple(param.shape), generator=generator) * NOISE_SCALE
        if isinstance(param, DTensor):
            param.add_(distribute_tensor(noise.to(param.dtype), param.device_mesh, param.placements))
        else:
            param.add_(noise.to(param.dtype).to(param.device))
        plain_params[name].add_(noise.to(plain_params[name].dtype).to(plain_params[name].device))
