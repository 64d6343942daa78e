"""Stopping a run on SIGTERM or SIGINT with a checkpoint (``trainer.save_on_signal``).

Slurm, scancel and Kubernetes send SIGTERM and, after a grace period, SIGKILL; Ctrl-C sends
SIGINT. While ``TrainingLoop.train`` runs, :class:`StopRequest` turns the first such signal
into a request: the step in progress finishes (a step cut in the middle would leave weights
that match no checkpoint, and other processes waiting in a collective), the processes agree
at the step boundary that one of them was asked to stop (:meth:`StopRequest.agreed`, a MAX
all-reduce, so a process that got the signal a moment before the others stops at the same
step as they do), every process takes part in the checkpoint of that step, the main process
prints one line naming it, and ``train`` raises :class:`TrainingStopped`; ``grouprl train``
exits with status 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as a shell
reports a process killed by that signal.

A second signal exits at once with the same kind of status (128 + its number), without
saving: checkpoints are written atomically, so one cut short leaves the previous one usable.
A repeat of the first signal within ``REPEAT_WINDOW_S`` counts as the same request: under
``torchrun`` the agent forwards the signal it got to every worker, and a scheduler such as
Slurm may signal the workers directly as well, so each may receive it twice at once.

Handlers are installed only in the main thread (Python delivers signals there) and the
previous ones are restored when ``train`` returns, so library use leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

# the signals that stop a run with a checkpoint
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# a repeat within this many seconds of the first signal is the same request delivered twice
REPEAT_WINDOW_S = 2.0


def exit_status(signum: int) -> int:
    """The exit status of a run stopped by signal ``signum``: 128 + its number, as shells report."""
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class TrainingStopped(Exception):
    """``train`` stopped early on a signal: ``checkpoint`` holds step ``step`` (None: no step was
    trained, nothing saved); ``exit_status`` is what ``grouprl train`` exits with."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint (no step trained)"
        super().__init__(f"stopped by {signal_name(signum)} after step {step}: {where}")

    @property
    def exit_status(self) -> int:
        return exit_status(self.signum)


class StopRequest:
    """While entered (``with``), SIGTERM and SIGINT request a stop instead of ending the process.

    ``enabled`` False (``trainer.save_on_signal: false``) installs nothing: the signals keep their
    previous meaning. ``label`` prefixes the messages (e.g. the process's rank).
    """

    def __init__(self, enabled: bool = True, *, label: str = ""):
        self.enabled = enabled
        self.label = label
        self.signum = 0  # the first signal received here; 0: none
        self.checkpoint_written: Path | None = None  # set once the stop's checkpoint is on disk
        self._first_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            # None: a handler not installed from Python, which cannot be put back; leave the default
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _say(self, text: str) -> None:
        # os.write, not print: the handler may run while the main thread is inside a print
        try:
            os.write(2, f"grouprl: {self.label}{text}\n".encode())
        except OSError:  # stderr's reader is gone (a `| tee` ended by the same Ctrl-C): the stop goes on unsaid
            pass

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        name = signal_name(signum)
        if not self.signum:
            self.signum, self._first_at = signum, now
            self._say(f"{name} received: finishing the step in progress, then saving a checkpoint "
                      f"(a second signal exits at once, without saving)")
            return
        if now - self._first_at < REPEAT_WINDOW_S:
            return  # the same request, delivered by both a scheduler and torchrun
        if self.checkpoint_written is not None:
            self._say(f"{name} again: exiting now; checkpoint {self.checkpoint_written} is complete")
        else:
            self._say(f"{name} again: exiting now without saving; the last checkpoint written before stays usable")
        os._exit(exit_status(signum))

    def agreed(self, accelerator) -> int:
        """The signal any process received (the highest number if several), 0 if none: a collective,
        called by every process at the same step boundary, so that they all stop there together."""
        if accelerator.num_processes == 1:
            return self.signum
        import torch

        flag = torch.tensor([self.signum], dtype=torch.int64, device=accelerator.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())
