"""The best checkpoint's rule: which validation wins (``trainer.best_metric``, ``trainer.best_mode``) and its record.

The run loop (``trainer.loop``) asks :func:`improves` after each validation and keeps the
winner's checkpoint as ``<checkpoint dir>/best`` (``trainer.checkpoint.keep_best`` /
``save_best``); the record travels in every later checkpoint's ``trainer_state.json``
(``extra["best"]``) and in ``run_info.json`` (``"best"``), so that a resumed run knows the
value to beat.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from grouprl.config import ConfigError
from grouprl.trainer.checkpoint import BEST_DIR


@dataclass(frozen=True)
class BestRecord:
    """The best validation so far: ``metric`` (a metrics.jsonl key), ``mode`` (max or min), the ``step``
    it was logged at and its ``value``."""

    metric: str
    mode: str
    step: int
    value: float

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved) -> BestRecord | None:
        """The record a trainer_state.json holds (``extra["best"]``), or None when it holds none or a malformed one."""
        if not isinstance(saved, dict):
            return None
        try:
            return cls(str(saved["metric"]), str(saved["mode"]), int(saved["step"]), float(saved["value"]))
        except (KeyError, TypeError, ValueError):
            return None


def improves(value: float, best: float | None, mode: str) -> bool:
    """Whether ``value`` beats ``best`` under ``mode``: strictly (a tie keeps the earlier step), and a NaN
    or infinite value never wins; with no best yet any finite value does.

        max: value > best        min: value < best
    """
    if not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def metric_value(logged: dict[str, float], metric: str, step: int) -> float:
    """The value of ``metric`` in a validation's logged metrics (full keys, ``val/...``); a ConfigError
    naming ``trainer.best_metric`` and the keys the validation did log when it is not among them."""
    if metric in logged:
        return float(logged[metric])
    import difflib

    near = difflib.get_close_matches(metric, list(logged), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ConfigError(f"config key 'trainer.best_metric' is {metric!r}, which the validation at step {step} did not "
                      f"log{hint}; it logged: {', '.join(sorted(logged))}")


def best_path(checkpoint_dir: Path) -> Path:
    """Where the best checkpoint is kept: ``<checkpoint dir>/best``."""
    return Path(checkpoint_dir) / BEST_DIR
