"""Helpers for the tests that talk to a real reward server over sockets (not a test module)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import pytest


def two_free_ports() -> int:
    """A port P such that P and P + 1 are both free now (for ``--ports 2``); skips the test if none."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
        return base
    pytest.skip("no two consecutive free ports")


@contextmanager
def app_in_thread(app):
    """Serve ``app`` under uvicorn in a daemon thread on a free port; yields the port."""
    uvicorn = pytest.importorskip("uvicorn")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "reward server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1]
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        sock.close()
