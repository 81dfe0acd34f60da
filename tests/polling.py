"""Waiting for what a test started: a free port to bind, a condition to hold."""

from __future__ import annotations

import socket
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond, what: str, timeout: float = 60.0, step: float = 0.02):
    """Wait for a condition; the limit only bounds a hang, it asserts no speed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")
