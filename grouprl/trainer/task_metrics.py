"""Task metrics: what a validation measures beside the rewards, named in ``trainer.val_metrics``.

A reward scores one response for training; a task metric scores the whole validation set
against its references, the way a paper's table does (a micro-F1 pools every report's
findings: it is not the mean of per-report values). Domains register theirs by name in
:data:`TASK_METRICS` (radiology ``report``, reasoning ``exact_match``, diffusion ``shapes``);
any package can, through the ``grouprl.plugins`` entry points, as for rewards.

The contract (text and image runs alike)::

    metric(completions, references, *, prompts, prompt_index, **columns) -> {key: float}

- ``completions``: every validation response, in the validation set's order, the
  ``worker.rollout.val_n`` responses of a prompt together; text (``str``) for language and
  vision-language runs, a ``PIL.Image`` for flow runs;
- ``references``: each row's reference (the record's ``answer``; None where it has none);
- ``prompts``: each row's prompt text; ``prompt_index``: the position of its prompt in the
  validation set (rows with one index are one prompt's samples);
- ``columns``: the records' other fields, one value per row (``data_source``, ...).

The trainer logs each returned key as ``val/<name>/<key>`` in metrics.jsonl (``val/`` is
the prefix every validation metric gets). Values are numbers; NaN is a metric's own "no
value" (e.g. F1 with no positive), logged as NaN. A metric that raises, or returns anything
but a mapping of names to numbers, stops the validation with an error naming it: never a 0.

With several processes, each generates its share of the validation set; the rows are
gathered (``accelerate.utils.gather_object``) and put back in dataset order, and every
process computes every metric on the whole set: no collective beyond the gather, each
process declares the same keys, and the numbers equal a one-process run's.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from grouprl.config import ConfigError
from grouprl.registry import Registry

TaskMetric = Callable[..., Mapping[str, float]]

# the names validation already logs under val/ (val/reward/..., val/rewards/<key>/...)
RESERVED_NAMES = ("reward", "rewards")
# keyword arguments of the contract: a record column of that name is not passed twice
CONTRACT_ARGS = ("completions", "references", "prompts", "prompt_index")


class TaskMetricError(RuntimeError):
    """A task metric that failed, or returned something other than ``{key: number}``; names the metric."""


def _check_metric(name: str, obj: Any) -> None:
    if name in RESERVED_NAMES:
        raise ValueError(f"validation metric name {name!r} is taken by the reward metrics (val/{name}/...)")
    if not callable(obj):
        raise TypeError(f"validation metric {name!r} must be callable, got {type(obj).__name__}")


TASK_METRICS: Registry[TaskMetric] = Registry("validation metric", error=ConfigError, check=_check_metric,
                                              reserved="/")


def check_task_metric_names(names: Sequence[str], key: str = "trainer.val_metrics") -> None:
    """Every name in ``names`` is registered (plugins' included) and named once; ConfigError naming ``key``.

    Called by the config checks, before any model loads.
    """
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ConfigError(f"config key '{key}' is a list of validation metric names; got {names!r}")
    for name in names:
        if not isinstance(name, str) or name not in TASK_METRICS.names():
            raise ConfigError(f"config key '{key}': {TASK_METRICS.unknown_message(name)}")
    repeated = sorted({n for n in names if list(names).count(n) > 1})
    if repeated:
        raise ConfigError(f"config key '{key}' names {', '.join(repeated)} more than once")


@dataclass
class Generations:
    """The validation set's responses, one row per response (see the module docstring for each field)."""

    completions: list
    references: list
    prompts: list[str]
    prompt_index: list[int]
    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.completions)

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, Any]]) -> "Generations":
        """From per-row dicts with ``completion``, ``reference``, ``prompt``, ``prompt_index`` and ``columns``,
        put in dataset order (stable: a prompt's samples keep their order)."""
        rows = sorted(rows, key=lambda r: r["prompt_index"])
        names = sorted({k for r in rows for k in r.get("columns", {})} - set(CONTRACT_ARGS))
        return cls(completions=[r["completion"] for r in rows], references=[r["reference"] for r in rows],
                   prompts=[r["prompt"] for r in rows], prompt_index=[r["prompt_index"] for r in rows],
                   columns={k: [r.get("columns", {}).get(k) for r in rows] for k in names})


def gather_generations(rows: list[dict], accelerator=None) -> Generations:
    """Every process's rows (see :meth:`Generations.from_rows`), gathered, in dataset order."""
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        rows = gather_object(rows)
    return Generations.from_rows(rows)


def compute_task_metrics(names: Sequence[str], generations: Generations) -> dict[str, float]:
    """``{"<name>/<key>": value}`` of every metric in ``names`` on the whole validation set.

    Raises :class:`TaskMetricError` naming the metric when it raises or returns anything but
    ``{str: real number}``.
    """
    out: dict[str, float] = {}
    for name in names:
        metric = TASK_METRICS.get(name)
        try:
            values = metric(list(generations.completions), list(generations.references),
                            prompts=list(generations.prompts), prompt_index=list(generations.prompt_index),
                            **{k: list(v) for k, v in generations.columns.items()})
        except Exception as exc:
            raise TaskMetricError(f"validation metric {name!r} (trainer.val_metrics) failed on {len(generations)} "
                                  f"responses: {type(exc).__name__}: {exc}") from exc
        if not isinstance(values, Mapping):
            raise TaskMetricError(f"validation metric {name!r} (trainer.val_metrics) returned "
                                  f"{type(values).__name__}, not a mapping of metric names to numbers")
        for key, value in values.items():
            if not isinstance(key, str) or not key:
                raise TaskMetricError(f"validation metric {name!r} returned a key {key!r}: keys are non-empty strings")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TaskMetricError(f"validation metric {name!r} returned {key!r} = {value!r}: values are numbers")
            out[f"{name}/{key}"] = float(value)
    return out


def record_task_metrics(metrics, values: Mapping[str, float]) -> None:
    """Add ``values`` to ``metrics`` (a ``StepMetrics``): every process holds the same value, a ``mean`` of
    weight 1 on each, so the reduction gives it back (NaN stays NaN)."""
    for key, value in values.items():
        metrics.mean(key, value)


def validation_task_metrics(metrics, names: Sequence[str], rows: list[dict], accelerator=None) -> None:
    """The trainers' one call: gather ``rows``, compute the metrics in ``names``, record them in ``metrics``."""
    if names:
        record_task_metrics(metrics, compute_task_metrics(names, gather_generations(rows, accelerator)))
