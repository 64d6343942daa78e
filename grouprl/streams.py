"""Standard output and error that outlive a closed pipe, so that a run never dies of its console.

``grouprl train c.yaml 2>&1 | tee train.log`` and Ctrl-C: the terminal sends SIGINT to the
whole pipeline, ``tee`` exits at once, and the run, which saves a checkpoint on SIGINT, is
left writing to a pipe nobody reads. Python ignores SIGPIPE (kept so: a signal would kill the
run without its checkpoint), so every later write raises ``BrokenPipeError``, from wherever it
happens to be: a metrics line in the middle of a step, the line naming the checkpoint, the
interpreter's own flush at exit (which then prints "Exception ignored ... BrokenPipeError" and
exits with status 120).

:func:`install` (run first by ``grouprl.cli.main``) puts a :class:`PipeSafeStream` in front
of ``sys.stdout`` and ``sys.stderr``, and points the logging handlers that already hold one of
them at it. Every console writer (``print``, rich consoles, logging, warnings, tqdm bars) writes
through them, since each looks the stream up when it writes or is created after ``install``.
The first write or flush that finds its pipe closed points the stream's file descriptor at
``os.devnull`` (what Python's documentation recommends for a broken stdout): that write and every
later one, by Python or C code writing to the descriptor (``os.write(2, ...)`` in a signal
handler, the final flush at exit), succeed and go nowhere. The run's files hold what matters
(metrics.jsonl, the checkpoints); a console nobody reads loses nothing.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import sys
from typing import Any


def _is_closed_pipe(exc: OSError) -> bool:
    # EPIPE: the reader is gone; EINVAL is what Windows reports for the same
    return isinstance(exc, BrokenPipeError) or exc.errno in (errno.EPIPE, errno.EINVAL)


def silence_fd(fd: int) -> None:
    """Point file descriptor ``fd`` at ``os.devnull``: writes to it succeed and go nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class PipeSafeStream(io.TextIOBase):
    """A text stream in front of ``stream`` whose writes and flushes never raise for a closed pipe.

    On the first ``BrokenPipeError`` the stream's file descriptor is pointed at ``os.devnull``
    (:func:`silence_fd`) and the write is dropped; ``closed_pipe`` is True from then on. Any
    other error is raised as it is. Everything else (``fileno``, ``isatty``, ``encoding``,
    ``buffer``) is the wrapped stream's.
    """

    def __init__(self, stream: Any):
        super().__init__()
        self.stream = stream
        self.closed_pipe = False

    def _drop(self) -> None:
        self.closed_pipe = True
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):  # no descriptor (a test's capture): nothing below to fix
            return
        silence_fd(fd)
        try:  # what the broken write left in the buffer now goes to devnull, not to the exit-time flush
            self.stream.flush()
        except OSError:
            pass

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            if not _is_closed_pipe(exc):
                raise
            self._drop()
            return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            if not _is_closed_pipe(exc):
                raise
            self._drop()
        except ValueError:  # flushed after the wrapped stream was closed (at exit): nothing to do
            pass

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return self.stream.closed

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:
        return getattr(self.stream, "errors", None)

    def __getattr__(self, name: str) -> Any:  # buffer, reconfigure, mode, name, line_buffering...
        return getattr(self.stream, name)


def install() -> None:
    """Put a :class:`PipeSafeStream` in front of ``sys.stdout`` and ``sys.stderr`` (once), and point
    the logging handlers that write to either at it."""
    for name in ("stdout", "stderr"):
        raw = getattr(sys, name)
        if raw is None or isinstance(raw, PipeSafeStream):
            continue
        safe = PipeSafeStream(raw)
        setattr(sys, name, safe)
        for handler in _stream_handlers():
            if handler.stream is raw:
                handler.setStream(safe)


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger(), *(logging.getLogger(n) for n in list(logging.root.manager.loggerDict))]
    found = []
    for logger in loggers:
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                found.append(handler)
    return found
