"""The run loop every RL trainer shares: train, resume, save, metric reduction, writers, validation cadence.

A trainer (``GRPOTrainer``, the flow trainer) implements one training step and its rollout;
everything around the steps lives here once, so that language and image runs resume, save and
log the same way. ``TrainingLoop.train`` runs these stages:

    0. the checkpoint ``trainer.resume`` names, refused when it was trained with a config that
       differs from this one in what trains (``trainer.resume_if_config_changed``; see
       ``trainer.resume_config``), before anything is written
    1. config.yaml and run_info.json (main process)
    2. resume from that checkpoint (one line when it is at or past the run's last step: nothing
       left to train); the writers cut their files back to the resumed step, or
       on a fresh start drop every step's rows (an earlier attempt killed before its first
       checkpoint), so that each step is logged once
    3. validation before training (``trainer.val_before_train``)
    4. each step: ``step`` -> metrics reduced across processes -> the health alarms judge them
       (config ``trainer.health``, module ``trainer.health``) -> metrics.jsonl (and the other
       loggers), rollouts.jsonl, completions.jsonl, and every ``trainer.log_samples_freq`` steps a
       samples table for the loggers (validation: at each one) -> validation every ``trainer.val_freq``
       steps (judged by the health alarms too) -> a checkpoint every ``trainer.save_freq`` steps; after
       the step that ends past ``trainer.max_wall_seconds`` (if set) no further step
    5. a last checkpoint, unless stage 4 just wrote it; the prefetcher and the writers closed

With ``trainer.best_metric``, a validation whose value beats the best so far (``trainer.best.improves``)
makes that step's checkpoint ``<checkpoint dir>/best``: hard-linked from the step's checkpoint
when the step is saved anyway (stage 4's cadence, stage 5), else written before the next step
changes the weights; its record goes into every later checkpoint's trainer_state.json and into
run_info.json. A resumed run takes the best so far from ``best/`` (see :meth:`TrainingLoop._restore_best`).
``validate_only`` runs one validation and nothing else (``grouprl validate``, ``trainer.val_only``).

On SIGTERM or SIGINT (``trainer.save_on_signal``, see ``trainer.signals``) the step in progress
finishes, the processes agree at the step boundary to stop, save that step's checkpoint together
(unless stage 4 just wrote it), the main process prints one line naming it, and ``train`` raises
``TrainingStopped`` (``grouprl train`` exits with 128 + the signal's number).

Hooks: a trainer implements ``step`` (returning a :class:`StepResult`), ``rollout`` (one step's
batch, sampled now) and ``validate``; it may override ``rollout_ahead`` and
``prepare_rollout_ahead`` (one_step_off), ``save_extras`` and ``on_resume`` (its own files in a
checkpoint, and reading them back) and ``run_info_extras``.

Its step starts by taking its batch, the same three lines in every trainer::

    stale = self.prefetcher.holds(step)
    batch = self.prefetcher.take(metrics) if stale else self.rollout(step, metrics)
    self.rollout_taken(step, metrics, stale=stale)

so that with ``trainer.async_mode: one_step_off`` step k+1's batch is sampled in a worker
thread (:class:`OneStepOffPrefetcher`) while step k trains, and in the other modes in line.
"""

from __future__ import annotations

import abc
import concurrent.futures
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grouprl.config import ConfigError, redacted, save_config
from grouprl.config.checks import check_best
from grouprl.files import check_writable_dir, write_text_atomic
from grouprl.trainer import checkpoint as ckpt
from grouprl.trainer.best import BestRecord, best_path, improves, metric_value
from grouprl.trainer.health import HealthWatch
from grouprl.trainer.logging import MetricsLogger, RolloutWriter, samples_due
from grouprl.trainer.metrics import SchemaFile, StepMetrics
from grouprl.trainer.parallel import full_state_dicts, process_layout, stage, staged
from grouprl.trainer.resume_config import check_resume_config
from grouprl.trainer.reward_metrics import UnscoredSteps
from grouprl.trainer.signals import StopRequest, TrainingStopped, signal_name


_CHOOSE = object()  # TrainingLoop.resume's default: the checkpoint trainer.resume names


def check_output_dirs(config) -> None:
    """The run directory and the checkpoint directory can be created and written to
    (:func:`~grouprl.files.check_writable_dir`): called where a trainer is built, before its
    model loads, so that a read-only or mistyped output path is one line naming it, not an error
    found after the load (or at the first checkpoint)."""
    check_writable_dir(config.run_dir, "run directory ('trainer.output_dir')")
    check_writable_dir(config.checkpoint_dir, "checkpoint directory ('trainer.save_checkpoint_path')")


@dataclass
class StepResult:
    """What one training step (or one validation) produced on this process.

    ``records``: the rows for rollouts.jsonl (from ``validate``: for val_generations.jsonl);
    ``completions``: the rows for completions.jsonl. None where there is nothing to write; it
    must be None on every process or on none, since writing gathers the rows from all of them.
    ``batch``: what the step trained on, kept for inspection (``TrainingLoop.last_step``), or None.
    ``images``: (caption, PIL image) pairs for the loggers' samples (a flow run's validation grid, a VLM
    run's prompt images); the main process's are logged, the others' are not gathered.
    """

    metrics: StepMetrics
    records: list[dict] | None = None
    completions: list[dict] | None = None
    batch: Any = None
    images: list[tuple[str, Any]] | None = None


class OneStepOffPrefetcher:
    """Samples step k+1's batch in a worker thread while step k trains (``trainer.async_mode: one_step_off``).

    At most one rollout is ahead. The worker runs with a StepMetrics of its own, which
    :meth:`take` merges into the metrics of the step that trains on the batch.
    """

    def __init__(self, thread_name: str = "grouprl-rollout"):
        self.thread_name = thread_name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def holds(self, step: int) -> bool:
        """Whether step ``step``'s batch has been started ahead (then :meth:`take` it)."""
        return self._pending is not None and self._pending[0] == step

    @property
    def running(self) -> bool:
        """Whether a rollout was started and not yet taken (the sampler may be busy)."""
        return self._pending is not None

    def start(self, step: int, rollout: Callable[[int, StepMetrics], Any]) -> None:
        """Run ``rollout(step, metrics)`` in the worker thread."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=self.thread_name)
        self._pending = (step, self._pool.submit(self._run, rollout, step))

    @staticmethod
    def _run(rollout, step: int) -> tuple[Any, StepMetrics]:
        metrics = StepMetrics()
        return rollout(step, metrics), metrics

    def take(self, metrics: StepMetrics) -> Any:
        """The batch started ahead, once done; its metrics and the wait (``timing/rollout_wait_s``) go to ``metrics``."""
        t0 = time.perf_counter()
        batch, ahead = self._pending[1].result()
        metrics.max("timing/rollout_wait_s", time.perf_counter() - t0)
        metrics.merge(ahead)
        self._pending = None
        return batch

    def wait(self, metrics: StepMetrics) -> None:
        """Block until the rollout under way, if any, is done with the sampler (before its weights change);
        the wait is ``timing/rollout_overhang_s``."""
        if self._pending is not None:
            t0 = time.perf_counter()
            concurrent.futures.wait([self._pending[1]])
            metrics.max("timing/rollout_overhang_s", time.perf_counter() - t0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pool, self._pending = None, None


@dataclass
class _Writers:
    """The run's output files other than checkpoints, opened once per ``train``."""

    metrics: MetricsLogger
    rollouts: RolloutWriter
    completions: RolloutWriter
    val_generations: RolloutWriter

    def close(self) -> None:
        for writer in (self.rollouts, self.completions, self.val_generations, self.metrics):
            writer.close()


class TrainingLoop(abc.ABC):
    """The stages of a run around a trainer's step (see the module docstring).

    A subclass calls ``super().__init__`` once its accelerator and prompt stream exist, and sets
    ``policy`` (the module checkpoints save), ``processor`` (saved beside it, or None),
    ``optimizer``, ``scheduler`` and ``precision``.
    """

    def __init__(self, config, *, accelerator, stream):
        t = config.trainer
        self.config = config
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.run_dir = config.run_dir
        self.stream = stream
        self.total_steps = t.max_steps or t.total_epochs * stream.batches_per_epoch
        check_best(t)  # here too for trainer kinds whose config checks do not call it
        if t.max_wall_seconds is not None and not t.max_wall_seconds > 0:
            raise ConfigError(f"config key 'trainer.max_wall_seconds' must be > 0 seconds; got {t.max_wall_seconds}")
        self.state = ckpt.TrainerState()
        self.schema_file = SchemaFile(self.run_dir / "metrics_schema.json", enabled=self.is_main)
        self.prefetcher = OneStepOffPrefetcher()  # started only under one_step_off
        self.health = HealthWatch(t.health, self.run_dir, main=self.is_main)  # its state is saved in checkpoints
        self.last_step: StepResult | None = None  # the last training step's result
        self._consumed_stream = stream.state()  # the data position after the last batch trained on
        self._checkpointed_step: int | None = None  # the step the newest checkpoint on disk holds
        self.unscored: UnscoredSteps | None = None  # which steps of the last ``train`` had no row scored
        self.resume_hint = "resume with trainer.resume=auto"  # the stop line's advice (a demo: run it again)
        self.best: BestRecord | None = None  # the best validation so far (trainer.best_metric)
        self._best_due: int | None = None  # a step whose validation won and whose checkpoint is not yet best/

    # ------------------------------------------------------------------ hooks

    @abc.abstractmethod
    def step(self, step: int) -> StepResult:
        """One training step on this process; its metrics are not yet reduced across processes."""

    @abc.abstractmethod
    def rollout(self, step: int, metrics: StepMetrics) -> Any:
        """Step ``step``'s batch, its prompts drawn from ``self.stream``, sampled and scored now."""

    @abc.abstractmethod
    def validate(self, step: int) -> StepResult | None:
        """Validation metrics and val_generations.jsonl rows; None when the run has no validation set."""

    def rollout_ahead(self, step: int, metrics: StepMetrics) -> Any:
        """Step ``step``'s batch, sampled in the prefetcher's thread while the previous step trains."""
        return self.rollout(step, metrics)

    def prepare_rollout_ahead(self) -> None:
        """On the main thread, before the prefetcher starts: e.g. give the sampler the trained weights."""

    def on_resume(self) -> None:
        """After a checkpoint is loaded: e.g. give the rollout engine the restored weights."""

    def save_extras(self, model_dir: Path) -> None:
        """On the main process, while a checkpoint is written: the trainer's own files beside the weights
        in ``model_dir`` (the flow trainer's moving average); ``on_resume`` reads them back."""

    def run_info_extras(self) -> dict:
        """What run_info.json says about this trainer beyond processes, device, precision and async mode."""
        return {}

    # ------------------------------------------------------------------ the step's batch

    def rollout_taken(self, step: int, metrics: StepMetrics, *, stale: bool) -> None:
        """The step has its batch: record the data position a checkpoint after this step resumes from,
        and under one_step_off log the staleness and start sampling the next step's batch."""
        self._consumed_stream = self.stream.state()
        if self.config.trainer.async_mode != "one_step_off":
            return
        metrics.mean("async/staleness_steps", float(stale))
        if step < self.total_steps:
            self.prepare_rollout_ahead()
            self.prefetcher.start(step + 1, self.rollout_ahead)

    # ------------------------------------------------------------------ metrics and records

    @staged("metrics")
    def reduce_metrics(self, metrics: StepMetrics, prefix: str = "") -> dict[str, float]:
        """Every process's metrics combined; the main process records each key's kind in metrics_schema.json.

        Counts under ``perf/`` (summed over processes) become rates, ``perf/{name}_per_s``, over
        the slowest process's ``timing/step_s``; other ``perf/`` keys (means such as
        ``perf/micro_batches``) stay as they are.
        """
        self.schema_file.record(metrics, prefix)
        kinds = dict(metrics.schema)
        values = metrics.reduce(self.accelerator)
        step_s = values.get("timing/step_s")
        if step_s:
            for key in [k for k in values if k.startswith("perf/") and kinds.get(k) == "sum"]:
                values[f"{key}_per_s"] = values.pop(key) / step_s
        return values

    @staged("records")
    def gather_records(self, records: list[dict]) -> list[dict]:
        """Every process's records, in process order, on every process (for the main one to write)."""
        if self.accelerator.num_processes == 1:
            return records
        from accelerate.utils import gather_object

        return gather_object(records)

    # every process's rank, local rank, node and host (parallel.process_layout), gathered once by train()
    processes: list[dict] | None = None

    def run_info(self) -> dict:
        """How this run is laid out (written to ``run_info.json``): processes, device, precision, async mode;
        once ``train`` has gathered them, ``num_nodes`` and ``processes`` (each one's ``rank``, ``local_rank``,
        ``node``: its node launcher's rank, ``num_nodes``, ``host``)."""
        info = {"num_processes": self.accelerator.num_processes, "device": str(self.accelerator.device),
                "precision": self.precision.describe(), "async_mode": self.config.trainer.async_mode,
                **self.run_info_extras()}
        if self.processes is not None:
            info["num_nodes"] = len({(p["host"], p["node"]) for p in self.processes})
            info["processes"] = self.processes
        if self.best is not None:
            info["best"] = {**self.best.as_dict(), "path": str(best_path(self.config.checkpoint_dir).resolve())}
        return info

    def _write_run_info(self) -> None:
        if self.is_main:
            write_text_atomic(self.run_dir / "run_info.json", json.dumps(self.run_info(), indent=2))

    # ------------------------------------------------------------------ checkpoints

    def resume_checkpoint(self) -> Path | None:
        """The checkpoint ``trainer.resume`` names (None: a fresh start), refused (ConfigError, one line
        naming each differing key and both values) when the config it was saved with differs from this
        run's in what trains, unless ``trainer.resume_if_config_changed`` (then one line names them)."""
        t = self.config.trainer
        path = ckpt.resume_path(t.resume, self.config.checkpoint_dir, accelerator=self.accelerator)
        if path is not None:
            saved = ckpt.load_trainer_state(path).extra.get("config")
            changes = check_resume_config(path, saved, redacted(self.config), allowed=t.resume_if_config_changed)
            if changes and self.is_main:
                print(f"grouprl: resuming {path} under a changed config (trainer.resume_if_config_changed): "
                      f"{'; '.join(changes)}", flush=True)
        return path

    def resume(self, path: Path | None | object = _CHOOSE) -> bool:
        """Load the checkpoint ``path`` (default: the one ``trainer.resume`` names, checked by
        :meth:`resume_checkpoint`); False when starting fresh."""
        if path is _CHOOSE:
            path = self.resume_checkpoint()
        if path is None:
            return False
        self.state = ckpt.restore_checkpoint(path, self.policy, self.optimizer, self.scheduler,
                                             process_index=self.accelerator.process_index,
                                             num_processes=self.accelerator.num_processes)
        self.stream.load_state(self.state.extra["stream"])
        self._consumed_stream = self.stream.state()
        self.health.load(self.state.extra.get("health"))  # an alarm fired before the checkpoint stays fired
        self.on_resume()
        if path.resolve().parent == self.config.checkpoint_dir.resolve():  # not one of another run's
            self._checkpointed_step = self.state.global_step
        self._restore_best(path)
        self.accelerator.print(f"resumed from {path} at step {self.state.global_step}")
        return True

    def _restore_best(self, resumed: Path) -> None:
        """The best so far of a resumed run: the record of ``best/`` on disk (of this ``trainer.best_metric``
        and mode), so that the run never replaces a better best with a worse one, even one saved after
        ``resumed`` by an attempt that was killed later. One case trusts ``resumed`` instead: it is the
        best's own step, saved, and the run was killed before ``best/`` was made from it; it is made now.
        The main process decides and tells the others (every process then holds the same value to beat)."""
        t = self.config.trainer
        if t.best_metric is None:
            return
        mode, root = t.best_mode or "max", self.config.checkpoint_dir

        def ours(saved) -> BestRecord | None:
            record = BestRecord.from_dict(saved)
            return record if record is not None and (record.metric, record.mode) == (t.best_metric, mode) else None

        decided: dict | None = None
        failure: str | None = None
        if self.is_main:
            try:
                on_disk = None
                if (best_path(root) / ckpt.COMPLETE_MARK).exists():
                    kept = ckpt.load_trainer_state(best_path(root))
                    on_disk = ours(kept.extra.get("best"))
                    if on_disk is not None and on_disk.step != kept.global_step:
                        on_disk = None  # not a best of ours: its record and its step disagree
                saved = ours(self.state.extra.get("best"))
                best = on_disk
                if (saved is not None and saved.step == self.state.global_step
                        and resumed.resolve().parent == root.resolve()
                        and (on_disk is None or (on_disk.step != saved.step and improves(saved.value, on_disk.value,
                                                                                          mode)))):
                    ckpt.keep_best(root, resumed)
                    best = saved
                decided = None if best is None else best.as_dict()
            except Exception as exc:  # told to the other processes first, which would otherwise wait forever
                failure = f"{type(exc).__name__}: {exc}"
                if self.accelerator.num_processes == 1:
                    raise
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            decided, failure = broadcast_object_list([decided, failure], from_process=0)
            if failure is not None:
                raise RuntimeError(f"the main process could not restore the best checkpoint's record: {failure}")
        self.best = BestRecord.from_dict(decided)
        if self.best is None:
            self.state.extra.pop("best", None)
        else:
            self.state.extra["best"] = self.best.as_dict()

    @staged("save")
    def save(self, *, best: bool = False) -> Path | None:
        """Write a checkpoint (every process takes part; the main one writes); ``best``: as ``best/``,
        not as the step's checkpoint.

        The model (if sharded) and the optimizer state are gathered whole, the optimizer's keyed
        by parameter name, so a checkpoint loads on any number of processes; with them every
        process's RNG state and the data position after the last batch trained on (one_step_off
        may have drawn the next one already).
        """
        from accelerate.utils import gather_object

        self.state.extra["stream"] = dict(self._consumed_stream)
        self.state.extra["config"] = redacted(self.config)  # what a resume compares its config with
        self.state.extra["health"] = self.health.state()
        model_state, optimizer_state = full_state_dicts(self.policy, self.optimizer)
        rng_states = gather_object([ckpt.rng_state()]) if self.accelerator.num_processes > 1 else [ckpt.rng_state()]
        path = None
        if self.is_main and best:
            path = ckpt.save_best(self.config.checkpoint_dir, self.state, self.policy, optimizer_state, self.scheduler,
                                  processor=self.processor, rng_states=rng_states, model_state_dict=model_state,
                                  extras=self.save_extras)
        elif self.is_main:
            path = ckpt.save_checkpoint(self.config.checkpoint_dir, self.state, self.policy, optimizer_state,
                                        self.scheduler, processor=self.processor,
                                        save_limit=self.config.trainer.save_limit, rng_states=rng_states,
                                        model_state_dict=model_state, extras=self.save_extras)
        self.accelerator.wait_for_everyone()
        if not best:
            self._checkpointed_step = self.state.global_step
        return path

    def _rank_validation(self, step: int, logged: dict[str, float]) -> None:
        """After a validation: whether its ``trainer.best_metric`` beats the best so far; if so the record
        is updated now (so that this step's checkpoint holds it) and its checkpoint becomes best/ at
        :meth:`_keep_best`. Every process reaches the same answer: the values are reduced."""
        t = self.config.trainer
        if t.best_metric is None:
            return
        value = metric_value(logged, t.best_metric, step)
        mode = t.best_mode or "max"
        if improves(value, None if self.best is None else self.best.value, mode):
            self.best = BestRecord(t.best_metric, mode, step, value)
            self.state.extra["best"] = self.best.as_dict()
            self._best_due = step

    @staged("save best")
    def _keep_best(self) -> None:
        """Make the winning step's checkpoint best/: a hard-linked copy of the step's checkpoint when it was
        just saved, else written (both collective: every process takes part or waits)."""
        step, self._best_due = self._best_due, None
        if step is None:
            return
        root = self.config.checkpoint_dir
        if self._checkpointed_step == step:
            if self.is_main:
                ckpt.keep_best(root, root / f"global_step_{step}")
            self.accelerator.wait_for_everyone()
        else:
            self.save(best=True)
        self._write_run_info()
        if self.is_main:
            print(f"grouprl: best checkpoint: step {step}, {self.best.metric} = {self.best.value:.6g} "
                  f"({self.best.mode}) -> {best_path(root)}", flush=True)

    # ------------------------------------------------------------------ the run

    def _open_writers(self, resume_step: int | None) -> _Writers:
        """The metrics logger and the JSONL writers; a resumed run's files are cut back to ``resume_step``."""
        t, main = self.config.trainer, self.is_main
        validating = t.val_before_train or t.val_freq > 0
        return _Writers(
            metrics=MetricsLogger(self.run_dir, t.logger, total_steps=self.total_steps, config=redacted(self.config),
                                  project=t.project_name, experiment=t.experiment_name, enabled=main,
                                  initial_step=self.state.global_step, resume_step=resume_step),
            rollouts=RolloutWriter(self.run_dir / "rollouts.jsonl", enabled=main and t.log_rollouts,
                                   resume_step=resume_step),
            completions=RolloutWriter(self.run_dir / "completions.jsonl", enabled=main and t.log_completions,
                                      resume_step=resume_step),
            val_generations=RolloutWriter(self.run_dir / "val_generations.jsonl", enabled=main and validating,
                                          resume_step=resume_step),
        )

    def _health(self, values: dict[str, float]) -> dict[str, float]:
        """The health alarms' metrics, their kind (the same on every process) in metrics_schema.json."""
        if values:
            declared = StepMetrics()
            for key in values:
                declared.max(key)
            self.schema_file.record(declared)
        return values

    def _write(self, writer: RolloutWriter, step: int, records: list[dict] | None,
               limit: int | None = None) -> list[dict] | None:
        """Every process's ``records`` (the first ``limit``) written; returns them (None when there were none)."""
        if records is None:
            return None
        rows = self.gather_records(records)[:limit]
        writer.write(step, rows)
        return rows

    def _log_samples(self, writers: _Writers, step: int, kind: str, rows: list[dict] | None,
                     result: StepResult) -> None:
        """The loggers' samples table of this step's rows and images (main process: the others log nothing)."""
        t = self.config.trainer
        if t.log_samples_freq == -1 or not self.is_main or not (rows or result.images):
            return
        writers.metrics.log_samples(step, kind, rows or [], images=result.images, limit=t.log_samples_rows)

    @staged("validation")
    def _validate(self, step: int, writers: _Writers) -> None:
        result = self.validate(step)
        if result is None:
            if self.config.trainer.best_metric is not None:
                raise ConfigError(f"config key 'trainer.best_metric' ({self.config.trainer.best_metric}) ranks "
                                  "validations, and the run has no validation data (data.val_files)")
            return
        logged = self.reduce_metrics(result.metrics, "val/")
        writers.metrics.log(step, logged, prefix="val/")
        named = {f"val/{k}": v for k, v in logged.items()}  # as metrics.jsonl names them
        changed = self._health(self.health.after_validation(step, named))
        if changed:  # one more row for this step: the alarm counts from the validation's step
            writers.metrics.log(step, changed)
        rows = self._write(writers.val_generations, step, result.records, self.config.trainer.val_generations_to_log)
        self._log_samples(writers, step, "val", rows, result)
        self._rank_validation(step, named)

    def validate_only(self, checkpoint: Path | None = None) -> tuple[int, dict[str, float], list[dict]]:
        """The configured validation, once, on the model or on ``checkpoint``'s weights (and a flow run's
        moving average): ``(step, metrics as metrics.jsonl names them, val_generations rows of every
        process)``. Nothing trains, no checkpoint and no file of the run directory is written (the flow
        trainer's image grid of the validation aside). ConfigError when the config has no validation data."""
        if checkpoint is not None:
            ckpt.load_model_weights(self.policy, checkpoint)
            self.state = ckpt.load_trainer_state(checkpoint)
            self.config.trainer.resume = str(checkpoint)  # where on_resume hooks read what the weights lack
            self.on_resume()
        self.schema_file.enabled = False  # metrics_schema.json is the training run's
        step = self.state.global_step
        with stage("validation", step=step):
            result = self.validate(step)
        if result is None:
            raise ConfigError("there is nothing to validate: the config has no validation data (data.val_files)")
        logged = {f"val/{k}": v for k, v in self.reduce_metrics(result.metrics, "val/").items()}
        records = self.gather_records(result.records) if result.records is not None else []
        return step, logged, records

    def train(self) -> dict[str, float]:
        """Run the remaining steps; returns the last step's metrics, reduced over processes.

        Raises :class:`~grouprl.trainer.signals.TrainingStopped` when a signal stopped the run
        (with ``trainer.save_on_signal``, after saving the last finished step).
        """
        t = self.config.trainer
        label = f"[process {self.accelerator.process_index}] " if self.accelerator.num_processes > 1 else ""
        with StopRequest(t.save_on_signal, label=label) as stop:
            return self._train(stop)

    def _train(self, stop: StopRequest) -> dict[str, float]:
        t = self.config.trainer
        # 0. the checkpoint to resume, checked against this config before anything is written: a refused
        # resume leaves the run directory's config.yaml the one its checkpoints were trained with
        checkpoint = self.resume_checkpoint()
        # 1. what the run is (where every process runs: a collective, which every process reaches here)
        self.processes = process_layout(self.accelerator)
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(self.config, self.run_dir / "config.yaml")
        self._write_run_info()
        # 2. where it starts: a killed run's lines after its last checkpoint are written again below;
        # a fresh start writes every step again (-1 keeps no step's rows, validation's step 0 included)
        resume_step = self.state.global_step if self.resume(checkpoint) else -1
        if self.best is not None:  # restored with the checkpoint
            self._write_run_info()
        if resume_step >= 0 and self.state.global_step >= self.total_steps and self.is_main:
            ends = ("trainer.max_steps" if t.max_steps else
                    f"trainer.total_epochs {t.total_epochs} x {self.stream.batches_per_epoch} batches")
            print(f"grouprl: nothing left to train: checkpoint {checkpoint} is at step {self.state.global_step} and "
                  f"the run ends at step {self.total_steps} ({ends}); raise it to train on", flush=True)
        writers = self._open_writers(resume_step)
        self.health.open(resume_step)
        self.logger = writers.metrics
        last: dict[str, float] = {}
        # no reward set (pure distillation): no step can be unscored
        keys = self.rewards.keys if self.rewards is not None else []
        unscored = self.unscored = UnscoredSteps(keys, fail=t.fail_on_unscored_steps, warn=self.is_main)
        try:
            # 3. the starting point's validation
            if t.val_before_train and self.state.global_step == 0:
                self._validate(0, writers)
                if self.total_steps > 0:  # else the run's one checkpoint (stage 5) is step 0's
                    self._keep_best()
            # 4. the steps (until total_steps, or the first step that ends past trainer.max_wall_seconds)
            started = time.perf_counter()
            while self.state.global_step < self.total_steps:
                if t.save_on_signal:
                    with stage("signal check"):  # a collective: a process that never comes is named
                        signum = stop.agreed(self.accelerator)
                    if signum:
                        self._stop(signum, stop)
                step = self.state.global_step + 1
                with stage("train", step=step):  # a collective that times out names the stage (parallel.py)
                    result = self.step(step)
                self.last_step = result
                last = self.reduce_metrics(result.metrics)
                last.update(self._health(self.health.after_step(step, last)))
                self.state.global_step = step
                self.state.epoch = self._consumed_stream["epoch"]
                self.state.batch_in_epoch = self._consumed_stream["batch_in_epoch"]
                writers.metrics.log(step, last)
                unscored.check(step, last)  # after the log: a run stopped here shows the step
                rows = self._write(writers.rollouts, step, result.records)
                self._write(writers.completions, step, result.completions)
                if samples_due(step, t.log_samples_freq):
                    self._log_samples(writers, step, "train", rows, result)
                if t.val_freq > 0 and step % t.val_freq == 0:
                    self._validate(step, writers)
                if t.save_freq > 0 and step % t.save_freq == 0:
                    self.save()
                if t.max_wall_seconds is not None and self._out_of_time(started, t.max_wall_seconds):
                    break
                if step < self.total_steps:  # the last step's best is linked from stage 5's checkpoint
                    self._keep_best()
            # 5. the end (a signal during the last step changes nothing: the run is complete)
            if self._checkpointed_step != self.state.global_step:
                self.save()
            self._keep_best()
        finally:
            self.prefetcher.close()
            writers.close()
        return last

    def _out_of_time(self, started: float, limit: float) -> bool:
        """Whether any process has run its steps for ``limit`` seconds: every process stops at the same step."""
        over = time.perf_counter() - started >= limit
        if self.accelerator.num_processes > 1:
            import torch

            flag = torch.tensor([1.0 if over else 0.0], device=self.accelerator.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            over = bool(flag.item())
        if over and self.is_main:
            print(f"grouprl: trainer.max_wall_seconds ({limit:g} s) reached after step {self.state.global_step}",
                  flush=True)
        return over

    def _stop(self, signum: int, stop: StopRequest) -> None:
        """Every process: checkpoint the last finished step (unless on disk already), name it, raise."""
        step = self.state.global_step
        path = None
        if step > 0:
            if self._checkpointed_step != step:
                self.save()
            path = (self.config.checkpoint_dir / f"global_step_{step}").resolve()
            stop.checkpoint_written = path
        if self.is_main:
            where = (f"checkpoint {path} ({self.resume_hint})" if path is not None
                     else "no step was trained, no checkpoint written")
            print(f"grouprl: stopped by {signal_name(signum)} after step {step}: {where}", flush=True)
        raise TrainingStopped(signum, step, path)
