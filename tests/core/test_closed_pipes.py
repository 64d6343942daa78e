"""A console whose reader is gone (``grouprl ... | head``, a ``tee`` ended by Ctrl-C) is written to
without an error: the output goes nowhere, the command's own exit status stands (no 120 from the
interpreter's final flush, no "Exception ignored ... BrokenPipeError")."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grouprl import streams

ROOT = Path(__file__).resolve().parents[2]


def run_with_stdout_unread(code: str) -> subprocess.CompletedProcess:
    """``python -c code`` whose stdout is a pipe whose read end was closed before it started."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    try:
        return subprocess.run([sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=300)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("flush", [True, False], ids=["print", "buffered until exit"])
def test_output_to_a_closed_pipe_exits_with_the_programs_status_and_says_nothing(flush):
    """A print that meets the closed pipe, or output left in the buffer for the interpreter's final
    flush (which would print "Exception ignored ... BrokenPipeError" and exit with 120)."""
    done = run_with_stdout_unread(
        "import sys; from grouprl import streams; streams.install(); "
        f"print('x' * 100, flush={flush}); print('still running', file=sys.stderr); sys.exit(3)")
    assert done.returncode == 3, done.stderr
    assert done.stderr == "still running\n"


def test_a_broken_pipe_silences_the_descriptor_and_a_handler_made_before_install_follows(monkeypatch):
    """In process: a logging handler that captured sys.stderr before ``install`` writes through the safe
    stream after it; the first write that meets a closed pipe points the descriptor at devnull, after
    which writes (the stream's and a raw ``os.write`` to the descriptor) succeed."""
    read_end, write_end = os.pipe()
    raw = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stderr", raw)
    handler = logging.StreamHandler()  # holds the raw stream, as a library's handler made at import would
    logger = logging.getLogger("grouprl.test_closed_pipes")
    logger.addHandler(handler)
    try:
        streams.install()
        assert isinstance(sys.stderr, streams.PipeSafeStream) and handler.stream is sys.stderr
        os.close(read_end)
        logger.warning("nobody reads this")  # would be a "--- Logging error ---" and BrokenPipeError
        assert sys.stderr.closed_pipe
        print("nor this", file=sys.stderr, flush=True)
        os.write(write_end, b"a signal handler's notice\n")
    finally:
        logger.removeHandler(handler)
        raw.close()
