"""Where metrics and rollouts go: the metrics loggers of ``trainer.logger``, and the rollouts JSONL files.

:class:`MetricsLogger` hands each step's metrics, and the samples tables, to the backends
``trainer.logger`` names (:mod:`grouprl.trainer.trackers`: console, metrics JSONL, TensorBoard,
W&B, MLflow, Trackio). A resumed run continues the files of the run it resumes. That run may have
logged steps past its last checkpoint before it died; given ``resume_step`` (the step of the
checkpoint resumed from), the writers first drop those steps, so that the files and TensorBoard
hold each step once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from grouprl.trainer.jsonl_files import jsonable, truncate_jsonl
from grouprl.trainer.trackers import CONSOLE_KEYS, LOGGERS, RunContext, Samples, sample_table

__all__ = ["CONSOLE_KEYS", "MetricsLogger", "RolloutWriter", "samples_due", "truncate_jsonl"]


def samples_due(step: int, freq: int) -> bool:
    """Whether step ``step``'s training samples go to the loggers: every ``freq``-th step
    (``trainer.log_samples_freq``); -1 never."""
    return freq > 0 and step % freq == 0


class MetricsLogger:
    """Writes one dict of scalar metrics per step, and samples tables, to each backend ``backends`` names.

    ``resume_step``: the step of the checkpoint a resumed run starts from. The JSONL file is cut back
    to it and TensorBoard hides the killed run's events after it; -1 (the run loop's fresh start) drops
    every step, e.g. those of an attempt killed before its first checkpoint, and starts new tracker
    runs; None appends.
    """

    def __init__(self, run_dir: Path, backends: list[str], *, total_steps: int, config: dict | None = None,
                 project: str = "grouprl", experiment: str = "run", enabled: bool = True, initial_step: int = 0,
                 resume_step: int | None = None):
        self.enabled = enabled
        self.backends = list(dict.fromkeys(backends))
        self.run_dir = run_dir
        self._backends = []
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        context = RunContext(run_dir, total_steps, config=config, project=project, experiment=experiment,
                             initial_step=initial_step, resume_step=resume_step)
        try:
            for name in self.backends:
                self._backends.append(LOGGERS.get(name)(context))
        except BaseException:
            self.close()  # the backends started so far (a console bar, a W&B process) end with the error
            raise

    def log(self, step: int, metrics: dict[str, float], *, prefix: str = "") -> None:
        metrics = {f"{prefix}{k}": v for k, v in metrics.items()}
        for backend in self._backends:
            backend.log_scalars(step, metrics, prefix)

    def log_samples(self, step: int, kind: str, records: list[dict], *, images: list | None = None,
                    limit: int | None = None) -> None:
        """``records`` (rollouts.jsonl or val_generations.jsonl rows, gathered) and ``images`` ((caption, PIL
        image) pairs) as one table per backend that has a place for them, at most ``limit`` rows and images."""
        if not self._backends or not (records or images):
            return
        samples: Samples = sample_table(kind, step, records, images=images, limit=limit)
        for backend in self._backends:
            backend.log_samples(step, samples)

    def close(self) -> None:
        backends, self._backends = self._backends, []
        for backend in backends:
            backend.close()


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
            self._fh.write(json.dumps({"step": step, **record}, default=jsonable) + "\n")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
