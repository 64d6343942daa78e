"""What a run directory holds, read for the report: the files a run writes, nothing else.

A run in progress is read as it stands: a last line still being written (no newline yet)
is left out without a word, since the next read will have it whole; any other line that is
not a JSON object is left out and counted in :attr:`Run.bad_lines`, which the page shows.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grouprl.files import RecordsError, read_json_records

# The files that make a directory a run directory: a run writes config.yaml and run_info.json
# before its first step, metrics.jsonl after it.
RUN_MARKERS = ("config.yaml", "run_info.json", "metrics.jsonl")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp")


class RunDirError(ValueError):
    """The report was asked for a directory that is missing or is not a run directory."""


@dataclass
class Run:
    """A run directory's contents, as the report uses them."""

    dir: Path
    config_text: str | None = None
    run_info: dict = field(default_factory=dict)
    metrics: dict[str, list[tuple[int, float | None]]] = field(default_factory=dict)  # key -> (step, value)
    schema: dict = field(default_factory=dict)
    rollouts: dict[int, list[dict]] = field(default_factory=dict)  # step -> records in file order
    val_generations: dict[int, list[dict]] = field(default_factory=dict)
    alarms: list[dict] = field(default_factory=list)
    checkpoints: list[tuple[str, dict]] = field(default_factory=list)  # (directory name, trainer_state.json)
    val_images: dict[int, list[Path]] = field(default_factory=dict)  # step -> grids under val_images/
    bad_lines: dict[str, int] = field(default_factory=dict)  # file name -> lines left out

    @property
    def best(self) -> dict | None:
        best = self.run_info.get("best")
        return best if isinstance(best, dict) else None

    @property
    def last_step(self) -> int | None:
        steps = [s for series in self.metrics.values() for s, _ in series]
        return max(steps) if steps else None


def _records(run: Run, name: str) -> list[dict]:
    """The JSON-object lines of ``run.dir / name`` (none if absent), a partial last line left out."""
    path = run.dir / name
    if not path.is_file():
        return []
    try:
        records = read_json_records(path, keep_bad=True)
    except RecordsError:  # unreadable as a whole (not UTF-8, a broken JSON list)
        run.bad_lines[name] = run.bad_lines.get(name, 0) + 1
        return []
    in_progress = records and isinstance(records[-1], RecordsError) and not path.read_bytes().endswith(b"\n")
    if in_progress:
        records = records[:-1]
    bad = sum(isinstance(r, RecordsError) for r in records)
    if bad:
        run.bad_lines[name] = bad
    return [r for r in records if isinstance(r, dict)]


def _json(run: Run, name: str) -> dict:
    path = run.dir / name
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):  # a file being replaced by a non-atomic writer
        run.bad_lines[name] = 1
        return {}
    return value if isinstance(value, dict) else {}


def _by_step(records: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        if isinstance(r.get("step"), int):
            out[r["step"]].append(r)
    return dict(sorted(out.items()))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def read_run(run_dir: str | Path) -> Run:
    """Read ``run_dir``; :class:`RunDirError` when it is missing or holds none of :data:`RUN_MARKERS`."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"{run_dir}: no such run directory")
    if not any((path / m).is_file() for m in RUN_MARKERS):
        raise RunDirError(f"{run_dir}: not a run directory (it has none of {', '.join(RUN_MARKERS)})")
    run = Run(path.resolve())
    if (path / "config.yaml").is_file():
        run.config_text = (path / "config.yaml").read_text(encoding="utf-8", errors="replace")
    run.run_info = _json(run, "run_info.json")
    run.schema = _json(run, "metrics_schema.json")
    series: dict[str, dict[int, float | None]] = defaultdict(dict)
    for row in _records(run, "metrics.jsonl"):
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for key, value in row.items():
            # a non-finite value is written as null: kept as a gap in the curve, not dropped
            if key != "step" and (value is None or _number(value) is not None):
                series[key][step] = _number(value)
    run.metrics = {k: sorted(v.items()) for k, v in sorted(series.items())}
    run.rollouts = _by_step(_records(run, "rollouts.jsonl"))
    run.val_generations = _by_step(_records(run, "val_generations.jsonl"))
    run.alarms = [a for a in _records(run, "alarms.jsonl") if isinstance(a.get("step"), int)]
    checkpoint_dir = _checkpoint_dir(run)
    if checkpoint_dir is not None and checkpoint_dir.is_dir():
        for state in sorted(checkpoint_dir.glob("*/trainer_state.json"), key=_checkpoint_order):
            run.checkpoints.append((state.parent.name, _read_state(state)))
    for image in sorted((path / "val_images").glob("step_*")):
        step = image.stem.removeprefix("step_")
        if image.suffix.lower() in IMAGE_SUFFIXES and step.isdigit():
            run.val_images.setdefault(int(step), []).append(image)
    return run


def _checkpoint_order(state: Path) -> tuple[int, str]:
    name = state.parent.name
    step = name.removeprefix("global_step_")
    return (int(step) if step.isdigit() else 1 << 62, name)


def _read_state(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    return value if isinstance(value, dict) else {}


def _checkpoint_dir(run: Run) -> Path | None:
    """``checkpoints/`` of the run, or the directory ``trainer.save_checkpoint_path`` in config.yaml names."""
    if run.config_text is not None:
        import yaml

        try:
            config = yaml.safe_load(run.config_text) or {}
        except yaml.YAMLError:
            config = {}
        saved = (config.get("trainer") or {}).get("save_checkpoint_path") if isinstance(config, dict) else None
        if saved:
            return Path(saved)
    return run.dir / "checkpoints"
