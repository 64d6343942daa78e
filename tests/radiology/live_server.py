"""A helper for the tests that start the reward server on ports of their own (not a test module).

An app served in a thread on a free port: the ``serve_app`` fixture (tests/conftest.py)."""

from __future__ import annotations

import socket

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
