"""The reward metrics of a training or validation step: one schema for the language and the flow trainer.

From a ``grouprl.rewards.RewardResult`` (per-row component values, ``None`` where a component
does not apply, and the weighted total): ``rewards/{key}/mean`` and ``/std`` over the rows where
the component applies, ``rewards/{key}/applicable_frac``, and ``reward/mean`` / ``reward/std`` of
the weighted total. Every key is declared on every process, whether or not a component applied to
any of its rows, because the processes reduce the same keys together (``trainer.metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from grouprl.rewards import RewardResult
from grouprl.trainer.metrics import StepMetrics


def record_rewards(metrics: StepMetrics, result: RewardResult, keys: Sequence[str], prefix: str = "") -> None:
    """Add one batch's reward statistics to ``metrics`` (``keys``: every component of the reward set).

    A component that applies to no row gets a NaN mean and std once reduced over every process.
    """
    n = len(result.total)
    for key in keys:
        values = [v for v in result.components.get(key, []) if v is not None]
        metrics.moments(f"{prefix}rewards/{key}", values)
        metrics.mean(f"{prefix}rewards/{key}/applicable_frac", len(values) / n if n else 0.0, n)
    metrics.moments(f"{prefix}reward", [t for t in result.total if t is not None])


def join_results(results: Sequence[RewardResult], keys: Sequence[str], weights: Mapping[str, float]) -> RewardResult:
    """The results of consecutive parts of a batch (micro-batches) as one result over all its rows, in order."""
    return RewardResult(components={k: [v for r in results for v in r.components[k]] for k in keys},
                        total=[t for r in results for t in r.total], weights=dict(weights))
