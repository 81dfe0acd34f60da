"""The readiness wait every local daemon (broker, registry) starts behind: a slow start that
keeps making progress is waited out; one that stalls is given up on."""

from __future__ import annotations

import itertools
import os
import time

from kvwire.kafka import daemon


def _ready_after(s: float):
    t0 = time.monotonic()
    return lambda: time.monotonic() - t0 >= s


def test_a_start_that_keeps_progressing_is_waited_out_past_the_timeout():
    ticks = itertools.count()  # a log that grows on every look
    why = daemon.wait_ready(os.getpid(), _ready_after(2.5), 1.0, progress=lambda: next(ticks), cap_s=30)
    assert why is None


def test_a_stalled_start_gives_up_after_the_timeout_and_says_so():
    # The stall's own message, not the cap's ("not ready after 30s"): it gave up at the stall.
    why = daemon.wait_ready(os.getpid(), lambda: False, 1.0, progress=lambda: 42, cap_s=30)
    assert why == "not ready, and no progress for 1s"


def test_progress_never_waits_past_the_cap():
    ticks = itertools.count()
    why = daemon.wait_ready(os.getpid(), lambda: False, 0.5, progress=lambda: next(ticks), cap_s=1.5)
    assert why is not None and why.startswith("not ready after")


def test_without_progress_the_timeout_counts_from_the_start():
    why = daemon.wait_ready(os.getpid(), _ready_after(2.5), 1.0)
    assert why is not None and why.startswith("not ready after")


def test_a_process_that_died_is_reported_at_once():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert daemon.wait_ready(pid, lambda: False, 30) == "exited during startup"
