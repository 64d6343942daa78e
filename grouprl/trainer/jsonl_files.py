"""JSON-lines run files (metrics.jsonl, rollouts.jsonl, ...): a value as JSON takes it, and the cut back to a step.

A resumed run continues the files of the run it resumes. That run may have logged steps past its
last checkpoint before it died; :func:`truncate_jsonl` drops those steps, so that the files hold
each step once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from grouprl.files import AtomicFile


def jsonable(value: Any) -> Any:
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
