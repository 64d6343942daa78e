"""A reward (length of the completion) that sends signals once, for the signal tests.

``SIGNAL_PLAN`` (JSON) says when and what: once ``metrics`` (a metrics.jsonl) holds step
``after_step``, the next call sends each of ``signals`` in turn, ``pause_s`` seconds apart, to
this process or, with ``"target": "parent"``, to its parent (torchrun's agent); with ``rank``,
only the process of that rank sends. Without ``SIGNAL_PLAN`` it is a plain reward.
"""

import json
import os
import time
from pathlib import Path

_sent = []


def _step_logged(metrics: Path, step: int) -> bool:
    if not metrics.exists():
        return False
    return any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line.strip())


def length_and_signals(prompts, completions, **kwargs):
    raw = os.environ.get("SIGNAL_PLAN")
    if raw and not _sent:
        plan = json.loads(raw)
        rank = plan.get("rank")
        if (rank is None or os.environ.get("RANK", "0") == str(rank)) and \
                _step_logged(Path(plan["metrics"]), plan["after_step"]):
            _sent.append(True)
            target = os.getppid() if plan.get("target") == "parent" else os.getpid()
            for i, signum in enumerate(plan["signals"]):
                if i:
                    time.sleep(plan.get("pause_s", 0))
                os.kill(target, signum)
    return [len(c) / 10 for c in completions]
