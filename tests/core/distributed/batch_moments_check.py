"""Run under `torchrun --nproc_per_node 2`: the trainer's cross-process batch statistics (gloo, CPU).

Both processes build the same 16 rows (4 groups of 4, two rewards; reward 1 scores none of
process 1's rows) and take their half. Each writes `<out>/rank<r>.json` with the moments of
reward 0's scored values over both halves (``grouprl.trainer.parallel.batch_moments``) and the GDPO advantages
of its half, computed with the batch statistics of both (batch std per reward, then the
renormalisation); tests/core/test_algorithms_gdpo.py compares them with one process on all 16 rows.

    torchrun --nproc_per_node 2 tests/core/distributed/batch_moments_check.py OUT_DIR
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from grouprl.algorithms import normalize_then_sum
from grouprl.trainer.parallel import batch_moments


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    scores = torch.rand(16, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    scores[8:, 1] = float("nan")
    scores[2, :] = float("nan")
    groups = torch.arange(4).repeat_interleave(4)
    mine = slice(0, 8) if rank == 0 else slice(8, 16)
    accelerator = SimpleNamespace(num_processes=world, device=torch.device("cpu"))
    column = scores[mine, 0]
    moments = batch_moments(column[~column.isnan()], accelerator)
    advantages, _ = normalize_then_sum(scores[mine], [1.0, 0.5], groups[mine], estimator_options={"std_level": "batch"},
                                       batch_moments_fn=functools.partial(batch_moments, accelerator=accelerator))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({
        "world_size": world, "rank": rank, "moments": list(moments), "advantages": advantages.tolist(),
        "scores": scores.tolist(), "groups": groups.tolist()}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
