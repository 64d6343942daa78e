"""The run report: one self-contained HTML file that shows what a run did (``grouprl report RUN_DIR``).

:func:`write_report` reads only the run directory (config.yaml, run_info.json and its ``best``,
metrics.jsonl, metrics_schema.json, rollouts.jsonl, val_generations.jsonl, alarms.jsonl,
the images the run saved, checkpoints' trainer_state.json) and writes ``report.html`` in it
(or ``out``), atomically: a browser reloading it during ``--watch`` sees the old page or the
new one. The page opens from disk with no server and no network: plotly.js is inline and
images are data: URIs. Domains add views of their rollout fields to
:data:`grouprl.report.views.RECORD_VIEWS`. docs/report.md describes the page.
"""

from __future__ import annotations

import time
from pathlib import Path

from grouprl.report.page import Caps
from grouprl.report.reading import RunDirError, read_run

__all__ = ["Caps", "RunDirError", "write_report", "watch_report"]


def write_report(run_dir: str | Path, out: str | Path | None = None, **caps: int) -> Path:
    """Write the report of ``run_dir`` to ``out`` (default ``run_dir/report.html``); its path.

    ``caps``: :class:`~grouprl.report.page.Caps` fields (``rollouts_per_step``, ``steps``,
    ``images``, ``text_chars``). Raises :class:`RunDirError` for a missing or non-run directory.
    """
    from grouprl.files import write_text_atomic
    from grouprl.report.page import render

    run = read_run(run_dir)
    path = Path(out) if out is not None else run.dir / "report.html"
    write_text_atomic(path, render(run, Caps(**caps)))
    return path


def watch_report(run_dir: str | Path, seconds: float, out: str | Path | None = None, *,
                 rounds: int | None = None, on_write=None, **caps: int) -> Path:
    """:func:`write_report` every ``seconds`` until interrupted (Ctrl-C), or ``rounds`` times; the path.

    ``on_write(path)`` is called after each write."""
    if seconds <= 0:
        raise ValueError(f"--watch takes a number of seconds above 0, got {seconds}")
    done = 0
    while True:
        path = write_report(run_dir, out, **caps)
        done += 1
        if on_write is not None:
            on_write(path)
        if rounds is not None and done >= rounds:
            return path
        time.sleep(seconds)
