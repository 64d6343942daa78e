"""Validation-only runs (``grouprl validate``, ``trainer.val_only``): the configured validation, once.

The trainer's own ``validate`` runs on the config's model or on a checkpoint's weights
(:meth:`~grouprl.trainer.loop.TrainingLoop.validate_only`): the same metrics as a training run
logs under ``val/`` and the same val_generations rows. Nothing trains, no checkpoint is written.
What it measured goes to ``validation.json`` (atomically) and to the console as a table::

    {"step": 40,                       # the checkpoint's step (0: the config's model)
     "checkpoint": "/abs/.../best",    # null: the config's model
     "metrics": {"val/reward/mean@1": 0.61, ...},   # as metrics.jsonl names them; null where not finite
     "generations": [{"id": ..., "response": ..., "reference": ..., "score": ...}, ...]}
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from grouprl.files import write_text_atomic

VALIDATION_FILE = "validation.json"
CHECKPOINT_WORDS = ("best", "latest")  # --checkpoint best / latest: in the config's checkpoint directory


def checkpoint_to_validate(given: str, checkpoint_dir: Path, *, option: str = "--checkpoint") -> Path:
    """The checkpoint ``given`` names, verified against its manifest: a path, or ``best`` (``<checkpoint
    dir>/best``) or ``latest`` (the newest intact ``global_step_N``). A missing or damaged checkpoint is a
    CheckpointError naming ``option`` and the path."""
    from grouprl.trainer import checkpoint as ckpt
    from grouprl.trainer.best import best_path

    path = Path(given)
    if given in CHECKPOINT_WORDS and not path.exists():
        if given == "best":
            path = best_path(checkpoint_dir)
            if not path.exists():
                raise ckpt.CheckpointError(f"{option} best: there is no best checkpoint at {path} (a run keeps one "
                                           "when trainer.best_metric is set)")
        else:
            found = ckpt.latest_checkpoint(checkpoint_dir)
            if found is None:
                raise ckpt.CheckpointError(f"{option} latest: there is no checkpoint under {checkpoint_dir}")
            path = found
    if not path.exists():
        raise ckpt.CheckpointError(f"{option} {given}: there is no checkpoint at {path}")
    found = ckpt.verify_checkpoint(path)
    if not found.intact:
        raise ckpt.CheckpointError(f"{option} {given}: checkpoint {path} is damaged: {found.describe()}")
    return path


def _finite(value):
    return value if not isinstance(value, float) or math.isfinite(value) else None


def metrics_table(metrics: dict[str, float], title: str):
    """A rich Table of the metrics, a key's standard error (``<key>_se``) beside its value."""
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_column("± se", justify="right")
    for key in sorted(metrics):
        if key.endswith("_se") and key[:-3] in metrics:
            continue
        se = metrics.get(f"{key}_se")
        table.add_row(key, f"{metrics[key]:.6g}", "" if se is None else f"{se:.3g}")
    return table


def run_validation(trainer, checkpoint: Path | None, out_dir: Path) -> Path | None:
    """Validate ``trainer``'s model (``checkpoint``'s weights when given); write ``out_dir/validation.json``
    and print the table on the main process, which gets the file's path (the others None)."""
    step, metrics, records = trainer.validate_only(checkpoint)
    if not trainer.is_main:
        return None
    from rich.console import Console

    out = Path(out_dir) / VALIDATION_FILE
    payload = {"step": step, "checkpoint": None if checkpoint is None else str(Path(checkpoint).resolve()),
               "metrics": {k: _finite(v) for k, v in sorted(metrics.items())}, "generations": records}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(payload, indent=2))
    what = f"checkpoint {checkpoint} (step {step})" if checkpoint is not None else "the config's model"
    Console().print(metrics_table(metrics, f"validation of {what}"))
    print(f"validation: {out.resolve()}", flush=True)
    return out
