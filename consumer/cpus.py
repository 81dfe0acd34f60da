"""Which CPUs a member's threads run on: ingest on one, the threads that answer on the others.

Why: ingest lets the GIL go for every slice the core applies (``apply_poll``), and CPython
then wakes a thread waiting for the GIL through a futex. Linux places a woken thread near its
waker, so an HTTP thread woken by ingest could wait on ingest's CPU, behind the apply that
runs there without the GIL, while another CPU idled: at p99 that wait was most of a score's
latency under ingest (``bench.score_latency``'s ``under_ingest``, docs/DESIGN.md "Where the tail
is"). A thread pinned away from ingest's CPU cannot be placed behind it.

Threads that ingest's loop starts for work of its own kind (``asyncio.to_thread``: snapshots,
name lookups) run on every CPU: the loop's default executor puts them back (``install``).
Linux only (``os.sched_setaffinity``); elsewhere, or with fewer than two CPUs allowed, there is
no split and every thread runs where the OS puts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuSplit:
    """``ingest``: the one CPU of the thread that applies records; ``serving``: those of the
    threads that answer (HTTP loops); ``every``: all the process may use."""

    ingest: frozenset[int]
    serving: frozenset[int]
    every: frozenset[int]

    @classmethod
    def of(cls, allowed: Iterable[int]) -> CpuSplit | None:
        """The split of ``allowed``; None under two CPUs. Ingest takes the highest-numbered:
        CPU 0 is where the kernel's housekeeping and most device interrupts land by default."""
        cpus = sorted(set(allowed))
        if len(cpus) < 2:
            return None
        return cls(frozenset(cpus[-1:]), frozenset(cpus[:-1]), frozenset(cpus))

    @classmethod
    def here(cls) -> CpuSplit | None:
        """The split of the CPUs this process may use (its cpuset, in a container)."""
        if not hasattr(os, "sched_setaffinity"):
            return None
        return cls.of(os.sched_getaffinity(0))

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        """Give ``loop`` a default executor whose threads run on every CPU, whatever the CPU of
        the thread that starts them (a new thread inherits its creator's). Before the loop has
        used its default executor, so that no thread of it stays on ingest's CPU."""
        loop.set_default_executor(ThreadPoolExecutor(initializer=self.pin, initargs=(self.every,)))

    def pin_ingest(self) -> bool:
        """The calling thread (ingest's loop) runs on ingest's CPU only."""
        return self.pin(self.ingest)

    def pin_serving(self) -> bool:
        """The calling thread (an HTTP loop) runs on the serving CPUs only."""
        return self.pin(self.serving)

    def unpin(self) -> bool:
        """The calling thread runs anywhere again."""
        return self.pin(self.every)

    @staticmethod
    def pin(cpus: frozenset[int]) -> bool:
        """Whether the calling thread now runs on ``cpus`` only. A refusal (a sandbox without
        the call, a cpuset changed under the process) leaves it where it was, with a warning:
        placement is an optimisation, never a reason for a member not to serve."""
        try:
            os.sched_setaffinity(0, cpus)  # 0: the calling thread
        except OSError as e:
            log.warning("threads not placed on CPUs %s: %s; they run where the OS puts them", sorted(cpus), e)
            return False
        return True
