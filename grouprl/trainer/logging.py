"""Where metrics and rollouts go: console, metrics JSONL, TensorBoard, optionally W&B."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

# What the console line shows, in order; everything is still written to the files.
CONSOLE_KEYS = (
    "sft/loss",
    "reward/mean",
    "reward/std",
    "frac_reward_zero_std",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/clipfrac",
    "actor/entropy",
    "response_length/mean",
    "response/truncation_rate",
    "timing/step_s",
    "perf/tokens_per_s",
)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes one dict of scalar metrics per step to each enabled backend."""

    def __init__(self, run_dir: Path, backends: list[str], *, total_steps: int, config: dict | None = None,
                 project: str = "grouprl", experiment: str = "run", enabled: bool = True, initial_step: int = 0):
        self.enabled = enabled
        self.backends = set(backends)
        self.console = Console(stderr=True)
        self.run_dir = run_dir
        self._jsonl = None
        self._tb = None
        self._wandb = None
        self._progress = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if "jsonl" in self.backends:
            # append: a resumed run continues the same file
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        if "wandb" in self.backends:
            try:
                import wandb
            except ImportError as exc:
                raise ImportError("trainer.logger includes 'wandb' but wandb is not installed: pip install 'grouprl[wandb]'") from exc
            self._wandb = wandb.init(project=project, name=experiment, config=config, dir=str(run_dir), resume="allow")
        if "console" in self.backends:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._task = self._progress.add_task("train", total=total_steps, completed=initial_step)
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float], *, prefix: str = "") -> None:
        if not self.enabled:
            return
        metrics = {f"{prefix}{k}": v for k, v in metrics.items()}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}) + "\n")
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        if "console" in self.backends:
            keys = [prefix + k for k in CONSOLE_KEYS]
            if prefix:  # validation metrics have their own names; show them all
                keys = sorted(metrics)
            shown = [f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float))]
            line = f"step {step}" + (f" [{prefix.rstrip('/')}]" if prefix else "") + ": " + " ".join(shown)
            if self._progress is not None:
                self._progress.console.print(line)
                if not prefix:
                    self._progress.update(self._task, completed=step)
            else:
                self.console.print(line)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class RolloutWriter:
    """Appends one JSON line per response: prompt, response, reward components, advantage, annotations."""

    def __init__(self, path: Path, enabled: bool = True):
        self.enabled = enabled
        self._fh = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", buffering=1)

    def write(self, step: int, records: list[dict[str, Any]]) -> None:
        if self._fh is None:
            return
        for record in records:
            self._fh.write(json.dumps({"step": step, **record}, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
