"""The reward metrics of a training or validation step: one schema for the language and the flow trainer.

From a ``grouprl.rewards.RewardResult`` (per-row component values, ``None`` where a component
does not apply, and the weighted total): ``rewards/{key}/mean`` and ``/std`` over the rows where
the component applies, ``rewards/{key}/applicable_frac``, and ``reward/mean`` / ``reward/std`` of
the weighted total, ``rewards/{key}/{part}/mean`` and ``/std`` of the parts a reward reports
beside its score (an EasyR1 reward's ``format``, ``accuracy``), and ``reward/unscored_steps``: 1
for a step in which no row on any process got a score, else 0 (the column summed over a run counts
such steps); ``reward_log/{name}``, the mean of the values reward functions gave TRL's
``log_metric(name, value)`` (a reward must log the same names on every process, as every metric is
reduced over all of them). Every key is declared on every process, whether or not a component
applied to any of its rows, because the processes reduce the same keys together (``trainer.metrics``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from grouprl.rewards import RewardResult, UnscoredError
from grouprl.trainer.metrics import StepMetrics

logger = logging.getLogger(__name__)

UNSCORED_STEPS = "reward/unscored_steps"


def record_rewards(metrics: StepMetrics, result: RewardResult, keys: Sequence[str], prefix: str = "") -> None:
    """Add one batch's reward statistics to ``metrics`` (``keys``: every component of the reward set).

    A component that applies to no row gets a NaN mean and std once reduced over every process.
    """
    n = len(result.total)
    for key in keys:
        values = [v for v in result.components.get(key, []) if v is not None]
        metrics.moments(f"{prefix}rewards/{key}", values)
        metrics.mean(f"{prefix}rewards/{key}/applicable_frac", len(values) / n if n else 0.0, n)
        # the parts an EasyR1 reward reports beside its overall score (format, accuracy, ...)
        for part, part_values in result.parts.get(key, {}).items():
            metrics.moments(f"{prefix}rewards/{key}/{part}", [v for v in part_values if v is not None])
    metrics.moments(f"{prefix}reward", [t for t in result.total if t is not None])
    for name, values in result.logged_metrics.items():
        metrics.mean(f"{prefix}reward_log/{name}", sum(values) / len(values), len(values))
    # a "min" over every batch part and process: 1 only if not one row anywhere was scored
    metrics.min(f"{prefix}{UNSCORED_STEPS}", float(all(t is None for t in result.total)))


def join_results(results: Sequence[RewardResult], keys: Sequence[str], weights: Mapping[str, float]) -> RewardResult:
    """The results of consecutive parts of a batch (micro-batches) as one result over all its rows, in order
    (a ``log_extra`` column or a reward's part one part of the batch has not logged is None on its rows)."""
    logged: dict[str, list[float]] = {}
    for r in results:
        for name, values in r.logged_metrics.items():
            logged.setdefault(name, []).extend(values)
    names = list(dict.fromkeys(name for r in results for name in r.logged_columns))
    columns = {name: [v for r in results for v in r.logged_columns.get(name, [None] * len(r.total))] for name in names}
    parts: dict[str, dict[str, list]] = {}
    for k in keys:
        part_names = list(dict.fromkeys(p for r in results for p in r.parts.get(k, {})))
        if part_names:
            parts[k] = {p: [v for r in results for v in r.parts.get(k, {}).get(p, [None] * len(r.total))]
                        for p in part_names}
    return RewardResult(components={k: [v for r in results for v in r.components[k]] for k in keys},
                        total=[t for r in results for t in r.total], weights=dict(weights),
                        logged_metrics=logged, logged_columns=columns, parts=parts)


class UnscoredSteps:
    """Watches a run's reduced step metrics for steps in which no row got a score.

    Such a step has a zero loss: a reward that returns None for every row (a misnamed column, a
    server that answers nothing) would train nothing while the run finishes without a word.
    The first such step is warned about on the main process, in one line naming the rewards;
    with ``fail`` (``trainer.fail_on_unscored_steps``) every process stops there together (the
    reduced value is the same on each) with an :class:`~grouprl.rewards.UnscoredError`.
    """

    def __init__(self, rewards: Sequence[str], *, fail: bool, warn: bool):
        self.rewards, self.fail, self.warn = list(rewards), fail, warn
        self.warned = False
        self.steps: list[int] = []  # the steps checked, and of them the unscored ones
        self.unscored: list[int] = []

    def check(self, step: int, values: Mapping[str, float]) -> None:
        """``values``: step ``step``'s metrics, reduced over every process."""
        self.steps.append(step)
        if values.get(UNSCORED_STEPS) != 1.0:
            return
        self.unscored.append(step)
        # None from every reward, or an on_error: none reward that failed: either way nothing applied
        what = f"step {step}: no row was scored (no reward applied to any row: {', '.join(self.rewards)})"
        if self.fail:
            raise UnscoredError(f"{what}; stopping, as trainer.fail_on_unscored_steps is set")
        if self.warn and not self.warned:
            self.warned = True
            logger.warning("%s; the step trained on nothing. Further such steps are counted in %s "
                           "(set trainer.fail_on_unscored_steps to stop instead)", what, UNSCORED_STEPS)

    def run_error(self) -> UnscoredError | None:
        """An :class:`~grouprl.rewards.UnscoredError` when every step checked was unscored: the run
        trained on nothing at all (``grouprl train`` exits with code 1); None otherwise."""
        if not self.steps or self.unscored != self.steps:
            return None
        span = f"step {self.steps[0]}" if len(self.steps) == 1 else f"steps {self.steps[0]}-{self.steps[-1]}"
        return UnscoredError(f"no row of any step was scored ({span}; no reward applied: {', '.join(self.rewards)}): "
                             "the run trained on nothing")
