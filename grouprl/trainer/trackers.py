"""The backends behind ``trainer.logger``: one class per backend, each logging scalars, samples, and closing.

A backend is built from a :class:`RunContext` and has three methods:

- ``log_scalars(step, metrics, prefix)``: one step's scalar metrics (``prefix`` "val/" for validation);
- ``log_samples(step, samples)``: a :class:`Samples` table (training rollouts or validation generations)
  with images, every ``trainer.log_samples_freq`` steps and at each validation;
- ``close()``.

Backends are looked up by name in :data:`LOGGERS` (a plugin may register another):
``console``, ``jsonl``, ``tensorboard``, ``wandb``, ``mlflow``, ``trackio``. The last three are optional
packages, imported when the backend starts, behind the extras of the same names.

A resumed run continues the same tracker run where the backend allows it: the W&B run id, the MLflow
run id and the Trackio run name are kept in ``RUN_DIR/tracking.json``. A resume (``resume_step`` >= 0) continues the stored
tracker run; any other start (a fresh start, -1, or an append, None) opens a new one. What each backend does with the steps a killed run logged after its checkpoint is said by each
class (metrics.jsonl and TensorBoard drop them; the trackers keep monotonic histories).
"""

from __future__ import annotations

import json
import math
import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.errors import require
from grouprl.files import write_text_atomic
from grouprl.registry import Registry
from grouprl.trainer.jsonl_files import jsonable, truncate_jsonl

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

TRACKING_FILE = "tracking.json"  # the tracker runs' ids, for a resume to continue them


@dataclass
class RunContext:
    """What a backend starts from: the run directory, the step range, the config, the names."""

    run_dir: Path
    total_steps: int
    config: dict | None = None
    project: str = "grouprl"
    experiment: str = "run"
    initial_step: int = 0
    resume_step: int | None = None  # see MetricsLogger

    def stored_id(self, backend: str) -> dict | None:
        """The tracker run this run directory logged to before, when this start is a resume (else None)."""
        if self.resume_step is None or self.resume_step < 0:
            return None
        path = self.run_dir / TRACKING_FILE
        try:
            return json.loads(path.read_text()).get(backend)
        except FileNotFoundError:
            return None
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{path}: not the JSON object grouprl writes ({exc}); delete it to start new "
                             "tracker runs") from exc

    def store_id(self, backend: str, entry: dict) -> None:
        """Remember ``backend``'s tracker run in ``RUN_DIR/tracking.json`` (atomically; other backends' kept)."""
        path = self.run_dir / TRACKING_FILE
        try:
            stored = json.loads(path.read_text())
        except (FileNotFoundError, ValueError):
            stored = {}
        stored = stored if isinstance(stored, dict) else {}
        stored[backend] = entry
        write_text_atomic(path, json.dumps(stored, indent=2))


@dataclass
class Samples:
    """One step's samples for the loggers: a table and images.

    ``kind``: "train" (from rollouts.jsonl's rows) or "val" (from val_generations.jsonl's).
    ``rows`` are lists of cells (str, int, float, bool or None) under ``columns``; ``images`` are
    (caption, PIL image) pairs: a flow run's validation grid, a VLM run's prompt images.
    """

    kind: str
    columns: list[str]
    rows: list[list[Any]]
    images: list[tuple[str, Any]] = field(default_factory=list)


# The columns a table starts with when the records have them; the rest follow in first-seen order.
_FIRST_COLUMNS = ("step", "id", "group", "prompt", "response", "completion", "reference", "score", "advantage")


def sample_table(kind: str, step: int, records: list[dict], *, images: list | None = None,
                 limit: int | None = None) -> Samples:
    """The first ``limit`` records as a :class:`Samples` table (all of them when None).

    Scalar fields become columns; the ``rewards`` dict becomes one ``reward/<name>`` column per
    component; other nested values (token lists, trained steps, reward logs) are left out, since
    rollouts.jsonl keeps them. A record without a column has None there.
    """
    rows = records[:limit] if limit is not None else records
    flat = [{"step": step, **_flatten(record)} for record in rows]
    seen = list(dict.fromkeys(k for record in flat for k in record))
    columns = [c for c in _FIRST_COLUMNS if c in seen] + [c for c in seen if c not in _FIRST_COLUMNS]
    return Samples(kind, columns, [[record.get(c) for c in columns] for record in flat],
                   list(images or [])[:limit] if limit is not None else list(images or []))


def _flatten(record: dict) -> dict:
    out = {}
    for key, value in record.items():
        if key == "rewards" and isinstance(value, dict):
            out.update({f"reward/{k}": v for k, v in value.items() if _scalar(v)})
        elif _scalar(value):
            out[key] = value
    return out


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def markdown_table(samples: Samples, *, max_chars: int = 2000) -> str:
    """``samples`` as a Markdown table (what TensorBoard's text tab renders): cells cut to
    ``max_chars``, pipes escaped and line breaks shown as ``<br>`` so that a completion stays in its cell."""
    def cell(value: Any) -> str:
        if isinstance(value, float):
            text = f"{value:.4g}"
        else:
            text = "" if value is None else str(value)
        if len(text) > max_chars:
            text = text[:max_chars] + "..."
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(samples.columns) + " |", "|" + "---|" * len(samples.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in samples.rows]
    return "\n".join(lines)


class Backend:
    """One logger backend (see the module docstring). ``package``/``extra``: the optional package it needs."""

    package: str | None = None
    extra: str | None = None

    def log_scalars(self, step: int, metrics: dict[str, float], prefix: str = "") -> None:
        raise NotImplementedError

    def log_samples(self, step: int, samples: Samples) -> None:
        """Backends without a place for tables and images log none (console, jsonl: rollouts.jsonl has them)."""

    def close(self) -> None:
        pass

    @classmethod
    def import_package(cls):
        return require(cls.package, extra=cls.extra,
                       needed_by=f"config key 'trainer.logger' (it includes {cls.name_in_config()})")

    @classmethod
    def name_in_config(cls) -> str:
        return next((name for name in LOGGERS if LOGGERS.get(name) is cls), cls.__name__)


def _finite_numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class ConsoleBackend(Backend):
    """A progress bar and one line per step of the keys in ``CONSOLE_KEYS`` (validation: all of its keys)."""

    def __init__(self, ctx: RunContext):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=False,
        )
        self._task = self._progress.add_task("train", total=ctx.total_steps, completed=ctx.initial_step)
        self._progress.start()

    def log_scalars(self, step, metrics, prefix=""):
        keys = [prefix + k for k in CONSOLE_KEYS]
        if prefix:  # validation metrics have their own names; show them all
            keys = sorted(metrics)
        shown = [f"{k}={metrics[k]:.4g}" for k in keys if isinstance(metrics.get(k), (int, float))]
        line = f"step {step}" + (f" [{prefix.rstrip('/')}]" if prefix else "") + ": " + " ".join(shown)
        self._progress.console.print(line)
        if not prefix:
            self._progress.update(self._task, completed=step)

    def close(self):
        self._progress.stop()


class JsonlBackend(Backend):
    """``RUN_DIR/metrics.jsonl``: one JSON line per step and per validation; non-finite values as null.

    A resume first cuts the file back to ``resume_step`` (:func:`truncate_jsonl`): each step once.
    """

    def __init__(self, ctx: RunContext):
        path = ctx.run_dir / "metrics.jsonl"
        if ctx.resume_step is not None:
            truncate_jsonl(path, ctx.resume_step)
        self._fh = open(path, "a", buffering=1)  # append: a resumed run continues the same file

    def log_scalars(self, step, metrics, prefix=""):
        self._fh.write(json.dumps({"step": step, **{k: jsonable(v) for k, v in metrics.items()}}) + "\n")

    def close(self):
        self._fh.close()


class TensorBoardBackend(Backend):
    """``RUN_DIR/tensorboard``: scalars; samples as a Markdown table (the text tab, ``samples/<kind>``) and
    images (``samples/<kind>/image_<i>``).

    A resume writes TensorBoard's restart marker (``purge_step``): TensorBoard then hides what the killed
    run logged after the checkpoint, scalars, text and images alike.
    """

    def __init__(self, ctx: RunContext):
        from torch.utils.tensorboard import SummaryWriter

        purge_step = None if ctx.resume_step is None else ctx.resume_step + 1
        self._tb = SummaryWriter(log_dir=str(ctx.run_dir / "tensorboard"), purge_step=purge_step)

    def log_scalars(self, step, metrics, prefix=""):
        for key, value in _finite_numbers(metrics).items():
            self._tb.add_scalar(key, value, step)
        self._tb.flush()

    def log_samples(self, step, samples):
        import numpy as np

        if samples.rows:
            self._tb.add_text(f"samples/{samples.kind}", markdown_table(samples), step)
        for i, (_, image) in enumerate(samples.images):
            self._tb.add_image(f"samples/{samples.kind}/image_{i}", np.asarray(image.convert("RGB")), step,
                               dataformats="HWC")
        self._tb.flush()


class WandbBackend(Backend):
    """Weights & Biases: scalars; samples as a ``wandb.Table`` (``samples/<kind>``) and ``wandb.Image``\\ s
    (``samples/<kind>/images``, with their captions). Honours ``WANDB_MODE`` (offline writes
    ``RUN_DIR/wandb/offline-run-*``, for ``wandb sync``) and the other ``WANDB_*`` settings.

    Resume: the run id is kept in tracking.json and the run continued (``resume="allow"``). W&B keeps
    each run's steps increasing, so the steps a killed run logged after its checkpoint keep the values
    first logged; grouprl does not send them again (W&B would drop them with a warning each).
    """

    package, extra = "wandb", "wandb"

    def __init__(self, ctx: RunContext):
        self._wandb = self.import_package()
        stored = ctx.stored_id("wandb")
        run_id = stored["id"] if stored else uuid.uuid4().hex[:12]
        ctx.store_id("wandb", {"id": run_id})
        self._run = self._wandb.init(project=ctx.project, name=ctx.experiment, config=ctx.config,
                                     dir=str(ctx.run_dir), id=run_id, resume="allow")
        # the steps this run logged already, which W&B would refuse to take again
        # a resumed W&B run starts at the step after the last one it took: the steps before it are not sent again
        self._logged_until = int(getattr(self._run, "step", 0) or 0) - 1 if stored else -1

    def _skip(self, step: int) -> bool:
        return step <= self._logged_until

    def log_scalars(self, step, metrics, prefix=""):
        if not self._skip(step):
            self._run.log(dict(metrics), step=step)

    def log_samples(self, step, samples):
        if self._skip(step):
            return
        wandb = self._wandb
        logged = {}
        if samples.rows:
            logged[f"samples/{samples.kind}"] = wandb.Table(columns=samples.columns, data=samples.rows)
        if samples.images:
            logged[f"samples/{samples.kind}/images"] = [wandb.Image(image, caption=caption)
                                                        for caption, image in samples.images]
        if logged:
            self._run.log(logged, step=step)

    def close(self):
        self._run.finish()


# MLflow metric and param names: alphanumerics, "_", "-", ".", " ", ":" and "/" (mlflow.utils.validation)
_MLFLOW_REFUSED = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_name(key: str) -> str:
    """A metric or param name MLflow accepts: ``@`` becomes ``_at_`` (``val/reward/mean@4`` ->
    ``val/reward/mean_at_4``), any other character MLflow refuses ``_``."""
    return _MLFLOW_REFUSED.sub("_", key.replace("@", "_at_"))


def flatten_config(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as dotted keys -> string values (lists and scalars as JSON), for tracker params."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


class MlflowBackend(Backend):
    """MLflow (``mlflow-skinny`` with SQLAlchemy): scalars (names through :func:`mlflow_name`), the config as
    params (dotted keys, values cut to MLflow's 6000 characters), samples as a table artifact
    (``samples/<kind>/step_<step>.json``, ``mlflow.log_table``'s format) and images (``log_image``, key
    ``samples/<kind>``). The store is ``MLFLOW_TRACKING_URI`` when set, else a SQLite file
    ``RUN_DIR/mlflow/mlflow.db`` with artifacts under ``RUN_DIR/mlflow/artifacts`` (``mlflow ui
    --backend-store-uri sqlite:///RUN_DIR/mlflow/mlflow.db`` shows it); the experiment is
    ``trainer.project_name``, the run ``trainer.experiment_name``.

    Resume: the run id is kept in tracking.json and the run continued. MLflow's metric histories only
    grow, so the steps a killed run logged after its checkpoint keep the values first logged (grouprl
    does not log them twice); params are immutable in MLflow, so a resume adds the keys the run lacks
    and leaves changed values as first logged (config.yaml holds the run's current config).
    """

    package, extra = "mlflow", "mlflow"

    def __init__(self, ctx: RunContext):
        from mlflow.utils import validation

        self.import_package()
        from mlflow.tracking import MlflowClient

        self._max_param = validation.MAX_PARAM_VAL_LENGTH
        self._max_key = validation.MAX_ENTITY_KEY_LENGTH
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        store = ctx.run_dir / "mlflow"
        if not uri:  # MLflow's SQLite store needs SQLAlchemy, which mlflow-skinny leaves out
            require("sqlalchemy", extra="mlflow", needed_by="config key 'trainer.logger' (it includes mlflow)")
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(store / 'mlflow.db').resolve()}"
        self._client = client = MlflowClient(tracking_uri=uri)
        stored = ctx.stored_id("mlflow")
        self._logged_until = -1
        if stored and stored.get("tracking_uri") == uri:
            self.run_id = stored["run_id"]
            client.update_run(self.run_id, status="RUNNING")
            self._logged_until = self._last_logged_step()
        else:
            experiment = client.get_experiment_by_name(ctx.project)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:  # our own store keeps its artifacts beside it, not under the working directory
                location = None if os.environ.get("MLFLOW_TRACKING_URI") else (store / "artifacts").resolve().as_uri()
                experiment_id = client.create_experiment(ctx.project, artifact_location=location)
            self.run_id = client.create_run(experiment_id, run_name=ctx.experiment).info.run_id
            ctx.store_id("mlflow", {"run_id": self.run_id, "tracking_uri": uri})
        if ctx.config:
            self._log_params(ctx.config)

    def _last_logged_step(self) -> int:
        run = self._client.get_run(self.run_id)
        steps = [m.step for key in run.data.metrics for m in self._client.get_metric_history(self.run_id, key)]
        return max(steps, default=-1)

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param

        have = self._client.get_run(self.run_id).data.params
        params = {}
        for key, value in flatten_config(config).items():
            name = mlflow_name(key)[:self._max_key]
            if name not in have:
                params[name] = value[:self._max_param]
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self.run_id, params=items[start:start + 100])

    def log_scalars(self, step, metrics, prefix=""):
        import time

        from mlflow.entities import Metric

        if step <= self._logged_until:
            return
        now = int(time.time() * 1000)
        items = [Metric(mlflow_name(k), v, now, step) for k, v in _finite_numbers(metrics).items()]
        for start in range(0, len(items), 1000):  # MLflow takes at most 1000 metrics per batch
            self._client.log_batch(self.run_id, metrics=items[start:start + 1000])

    def log_samples(self, step, samples):
        if step <= self._logged_until:
            return
        if samples.rows:
            self._client.log_table(self.run_id, data={c: [row[i] for row in samples.rows]
                                                      for i, c in enumerate(samples.columns)},
                                   artifact_file=f"samples/{samples.kind}/step_{step:06d}.json")
        for _, image in samples.images:
            self._client.log_image(self.run_id, image, key=mlflow_name(f"samples/{samples.kind}"), step=step)

    def close(self):
        self._client.set_terminated(self.run_id)


class TrackioBackend(Backend):
    """Trackio in its local mode (or the Space / server its ``TRACKIO_*`` settings name): scalars, samples as
    a ``trackio.Table`` (``samples/<kind>``) and ``trackio.Image``\\ s (``samples/<kind>/image_<i>``). Its
    local store is Trackio's own (``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``), where
    ``trackio show`` looks; the project is ``trainer.project_name``, the run ``trainer.experiment_name``
    with a short suffix that tells attempts apart.

    Resume: the run name is kept in tracking.json and the run continued (``resume="allow"``); the steps
    a killed run logged after its checkpoint keep the values first logged (grouprl does not log them twice).
    """

    package, extra = "trackio", "trackio"

    def __init__(self, ctx: RunContext):
        self._trackio = trackio = self.import_package()
        stored = ctx.stored_id("trackio")
        if stored and stored.get("project") == ctx.project:
            name = stored["name"]
        else:
            name = f"{ctx.experiment}-{uuid.uuid4().hex[:6]}"
            ctx.store_id("trackio", {"project": ctx.project, "name": name})
        self._run = trackio.init(project=ctx.project, name=name, config=ctx.config, resume="allow",
                                 embed=False, auto_log_gpu=False, auto_log_cpu=False)
        last = getattr(self._run, "_initial_last_step", None)  # the resumed run's last step, None when new
        self._logged_until = last if stored and last is not None else -1

    def log_scalars(self, step, metrics, prefix=""):
        if step > self._logged_until:
            self._run.log(_finite_numbers(metrics), step=step)

    def log_samples(self, step, samples):
        if step <= self._logged_until:
            return
        trackio = self._trackio
        logged = {}
        if samples.rows:
            logged[f"samples/{samples.kind}"] = trackio.Table(columns=samples.columns, data=samples.rows)
        for i, (caption, image) in enumerate(samples.images):
            logged[f"samples/{samples.kind}/image_{i}"] = trackio.Image(image, caption=caption)
        if logged:
            self._run.log(logged, step=step)

    def close(self):
        self._run.finish()


LOGGERS: Registry[type[Backend]] = Registry("logger")
LOGGERS.register("console", ConsoleBackend)
LOGGERS.register("jsonl", JsonlBackend)
LOGGERS.register("tensorboard", TensorBoardBackend)
LOGGERS.register("wandb", WandbBackend)
LOGGERS.register("mlflow", MlflowBackend)
LOGGERS.register("trackio", TrackioBackend)
