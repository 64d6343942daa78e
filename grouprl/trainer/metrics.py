"""Step metrics with a schema: each key says how it combines over micro-batches and processes.

Every process must reduce the same keys in the same order, or the collective reduction
fails (gloo: "Received data size doesn't match expected size") or hangs (NCCL). So a
metric is never "absent on this process": a reward that applied to no row of the
shard still reports its mean with count 0, and the reduction weighs it out.

Kinds:

- ``mean``: a weighted mean, sum(value * weight) / sum(weight) over every record on every
  process (weights: rows, tokens, or 1 for a per-step value). NaN when the total weight is 0.
- ``sum``: summed over records and processes (counts, and loss shares whose global
  normalisers already divide by the whole batch: their sum over processes is the loss).
- ``max`` / ``min``: extremes over records and processes (lengths, timings: a step takes
  as long as its slowest process).
- ``moments``: a mean and a population std over the values of every record of every
  process (``key/mean``, ``key/std``); exact, from sums of values and squares.
- ``mean_se``: an equally weighted mean over records (``key``) and its standard error
  (``key_se`` = population std / sqrt(count), the bootstrap's; ``trainer.val_metrics``); exact,
  from sums of values and squares.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable
from pathlib import Path

import torch

from grouprl.files import write_text_atomic

KINDS = ("mean", "sum", "max", "min", "moments", "mean_se")


class StepMetrics:
    """Accumulates one step's metrics on one process; :meth:`reduce` combines processes."""

    def __init__(self) -> None:
        self._kinds: dict[str, str] = {}
        self._mean: dict[str, list[float]] = {}  # key -> [sum(value * weight), sum(weight)]
        self._sum: dict[str, float] = {}
        self._max: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._moments: dict[str, list[float]] = {}  # key -> [sum x, sum x^2, n] (moments and mean_se)

    # ------------------------------------------------------------------ recording

    def _declare(self, key: str, kind: str) -> None:
        known = self._kinds.setdefault(key, kind)
        if known != kind:
            raise ValueError(f"metric {key!r} is recorded as {kind!r} but was declared {known!r}")

    def mean(self, key: str, value: float, weight: float = 1.0) -> None:
        """Add ``value`` with ``weight`` to a weighted mean; weight 0 declares the key and adds nothing."""
        self._declare(key, "mean")
        acc = self._mean.setdefault(key, [0.0, 0.0])
        if weight:
            acc[0] += float(value) * weight
            acc[1] += weight

    def sum(self, key: str, value: float = 0.0) -> None:
        self._declare(key, "sum")
        self._sum[key] = self._sum.get(key, 0.0) + float(value)

    def max(self, key: str, value: float | None = None) -> None:
        """Keep the largest value; None declares the key with no value from this process."""
        self._declare(key, "max")
        current = self._max.get(key, -math.inf)
        self._max[key] = current if value is None else max(current, float(value))

    def min(self, key: str, value: float | None = None) -> None:
        self._declare(key, "min")
        current = self._min.get(key, math.inf)
        self._min[key] = current if value is None else min(current, float(value))

    def moments(self, key: str, values: Iterable[float]) -> None:
        """Add values to ``key/mean`` and ``key/std``; an empty iterable declares the key."""
        self._declare(key, "moments")
        self._add_moments(key, values)

    def mean_se(self, key: str, values: Iterable[float]) -> None:
        """Add values to ``key`` (their mean) and ``key_se`` (its standard error); empty declares the key."""
        self._declare(key, "mean_se")
        self._add_moments(key, values)

    def _add_moments(self, key: str, values: Iterable[float]) -> None:
        acc = self._moments.setdefault(key, [0.0, 0.0, 0.0])
        for v in values:
            v = float(v)
            acc[0] += v
            acc[1] += v * v
            acc[2] += 1

    def merge(self, other: "StepMetrics") -> "StepMetrics":
        """Add another accumulator's records to this one (same kinds per key); returns self."""
        for key, kind in other._kinds.items():
            self._declare(key, kind)
        for key, (num, den) in other._mean.items():
            acc = self._mean.setdefault(key, [0.0, 0.0])
            acc[0] += num
            acc[1] += den
        for key, value in other._sum.items():
            self._sum[key] = self._sum.get(key, 0.0) + value
        for key, value in other._max.items():
            self._max[key] = max(self._max.get(key, -math.inf), value)
        for key, value in other._min.items():
            self._min[key] = min(self._min.get(key, math.inf), value)
        for key, (s, q, n) in other._moments.items():
            acc = self._moments.setdefault(key, [0.0, 0.0, 0.0])
            acc[0] += s
            acc[1] += q
            acc[2] += n
        return self

    @property
    def schema(self) -> list[tuple[str, str]]:
        """(key, kind) of every declared metric, sorted: what every process must agree on."""
        return sorted(self._kinds.items())

    def __contains__(self, key: str) -> bool:
        return key in self._kinds

    # ------------------------------------------------------------------ results

    def _vectors(self) -> tuple[list[float], list[float], list[float]]:
        """Summed, maxed and minned components, in schema order."""
        summed, maxed, minned = [], [], []
        for key, kind in self.schema:
            if kind == "mean":
                summed.extend(self._mean[key])
            elif kind == "sum":
                summed.append(self._sum[key])
            elif kind in ("moments", "mean_se"):
                summed.extend(self._moments[key])
            elif kind == "max":
                maxed.append(self._max[key])
            else:
                minned.append(self._min[key])
        return summed, maxed, minned

    def _finish(self, summed: list[float], maxed: list[float], minned: list[float]) -> dict[str, float]:
        out: dict[str, float] = {}
        s, mx, mn = iter(summed), iter(maxed), iter(minned)
        for key, kind in self.schema:
            if kind == "mean":
                num, den = next(s), next(s)
                out[key] = num / den if den else math.nan
            elif kind == "sum":
                out[key] = next(s)
            elif kind == "moments":
                total, squares, n = next(s), next(s), next(s)
                mean = total / n if n else math.nan
                out[f"{key}/mean"] = mean
                out[f"{key}/std"] = math.sqrt(max(squares / n - mean * mean, 0.0)) if n else math.nan
            elif kind == "mean_se":
                total, squares, n = next(s), next(s), next(s)
                mean = total / n if n else math.nan
                out[key] = mean
                out[f"{key}_se"] = math.sqrt(max(squares / n - mean * mean, 0.0) / n) if n else math.nan
            else:
                value = next(mx) if kind == "max" else next(mn)
                out[key] = value if math.isfinite(value) else math.nan
        return out

    def local(self) -> dict[str, float]:
        """This process's values, not combined with any other."""
        return self._finish(*self._vectors())

    def reduce(self, accelerator=None) -> dict[str, float]:
        """Combine every process's records (a collective: every process must call it).

        Before reducing, the processes check that they hold the same schema, so a
        metric missing on one process is an error naming the keys, not a hang.
        """
        world = 1 if accelerator is None else accelerator.num_processes
        if world == 1:
            return self.local()
        check_same_schema(self.schema, accelerator)
        summed, maxed, minned = self._vectors()
        device = accelerator.device
        # float64: sums of squares of many rewards lose the std in float32
        results = []
        for values, op in ((summed, "sum"), (maxed, "max"), (minned, "min")):
            tensor = torch.tensor(values, dtype=torch.float64, device=device)
            if len(values):
                torch.distributed.all_reduce(tensor, op=getattr(torch.distributed.ReduceOp, op.upper()))
            results.append(tensor.tolist())
        return self._finish(*results)


def check_same_schema(schema: list[tuple[str, str]], accelerator) -> None:
    """Raise on every process when the processes' metric schemas differ (names the differing keys)."""
    digest = hashlib.sha256(repr(schema).encode()).digest()
    value = int.from_bytes(digest[:7], "big")  # fits a signed int64
    mine = torch.tensor([value, -value], dtype=torch.int64, device=accelerator.device)
    torch.distributed.all_reduce(mine, op=torch.distributed.ReduceOp.MAX)
    if int(mine[0]) == value and int(mine[1]) == -value:
        return  # max == min == ours on every process
    gathered: list = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(gathered, schema)
    sets = [set(s) for s in gathered]
    differing = sorted({key for key, _ in set().union(*sets) - set.intersection(*sets)})
    raise RuntimeError(
        f"processes logged different metrics this step (process {accelerator.process_index} differs); "
        f"keys not logged the same way by every process: {differing[:20]}"
    )


class SchemaFile:
    """``metrics_schema.json``: every key logged so far and how processes combine it.

    Readers of ``metrics.jsonl`` need the kind of each key (a ``sum`` over processes
    reads differently from a ``mean``); the file is rewritten atomically whenever a
    step logs a key for the first time. Only the main process writes (``enabled``).
    """

    def __init__(self, path: Path, *, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self.kinds: dict[str, str] = {}

    def record(self, metrics: StepMetrics, prefix: str = "") -> None:
        if not self.enabled:
            return
        new = {f"{prefix}{key}": kind for key, kind in metrics.schema if f"{prefix}{key}" not in self.kinds}
        if new:
            self.kinds.update(new)
            write_text_atomic(self.path, json.dumps(dict(sorted(self.kinds.items())), indent=1))
