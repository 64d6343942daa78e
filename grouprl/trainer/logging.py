"""Where metrics and rollouts go: console, metrics JSONL, TensorBoard, optionally W&B.

A resumed run continues the files of the run it resumes. That run may have logged
steps past its last checkpoint before it died; given ``resume_step`` (the step of
the checkpoint resumed from), the writers first drop those steps, so that the
files and TensorBoard hold each step once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from grouprl.files import AtomicFile

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


def _record_step(line: bytes) -> int | None:
    """The step of one JSONL record; None for a record without one. Raises ValueError if the line is not JSON."""
    record = json.loads(line)  # bytes: a line cut inside a UTF-8 character fails here too
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def truncate_jsonl(path: Path, max_step: int) -> int:
    """Keep only the records of ``path`` whose "step" is <= max_step; returns how many lines were dropped.

    Records without a step are kept. A last line that is not valid JSON was cut by a kill and is
    dropped; an unparsable line elsewhere is not ours to judge and is kept. The file is rewritten
    atomically (:class:`~grouprl.files.AtomicFile`), so a kill now loses nothing; a file with
    nothing to change is left untouched.
    """
    if not path.exists():
        return 0
    dropped, changed = 0, False
    rewrite = AtomicFile(path, "wb")
    with rewrite as dst, open(path, "rb") as src:  # src is closed before the rename (Windows needs that)
        unparsable = None  # held back until a next line shows it was not the last
        for line in src:
            if unparsable is not None:
                dst.write(unparsable)
                unparsable = None
            if not line.endswith(b"\n"):  # only the last line can lack it: appends would glue onto it
                line, changed = line + b"\n", True
            try:
                step = _record_step(line)
            except ValueError:
                unparsable = line
                continue
            if step is not None and step > max_step:
                dropped += 1
            else:
                dst.write(line)
        if unparsable is not None:  # the last line, torn by the kill
            dropped += 1
        if not (dropped or changed):
            rewrite.discard()
    return dropped


class MetricsLogger:
    """Writes one dict of scalar metrics per step to each enabled backend.

    ``resume_step``: the step of the checkpoint a resumed run starts from. The JSONL file is cut back
    to it and TensorBoard hides the killed run's events after it; -1 (the run loop's fresh start) drops
    every step, e.g. those of an attempt killed before its first checkpoint; None appends.
    """

    def __init__(self, run_dir: Path, backends: list[str], *, total_steps: int, config: dict | None = None,
                 project: str = "grouprl", experiment: str = "run", enabled: bool = True, initial_step: int = 0,
                 resume_step: int | None = None):
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
            # append: a resumed run continues the same file, less the steps it will redo
            if resume_step is not None:
                truncate_jsonl(run_dir / "metrics.jsonl", resume_step)
            self._jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if "tensorboard" in self.backends:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step=T writes a restart marker: TensorBoard then drops the events of earlier
            # files whose step is >= T, i.e. what the killed run logged after the checkpoint
            purge_step = None if resume_step is None else resume_step + 1
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge_step)
        if "wandb" in self.backends:
            from grouprl.errors import require

            wandb = require("wandb", extra="wandb", needed_by="config key 'trainer.logger' (it includes wandb)")
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
    """Appends one JSON line per response: prompt, response, reward components, advantage, annotations.

    ``resume_step``: as for `MetricsLogger`, cut the file back to this step before appending. Pass it
    only to the writer opened once at resume, not to one opened again later in the same run.
    """

    def __init__(self, path: Path, enabled: bool = True, *, resume_step: int | None = None):
        self.enabled = enabled
        self._fh = None
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                truncate_jsonl(path, resume_step)
            self._fh = open(path, "a", buffering=1)

    def write(self, step: int, records: list[dict[str, Any]]) -> None:
        if self._fh is None:
            return
        for record in records:
            self._fh.write(json.dumps({"step": step, **record}, default=_jsonable) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
