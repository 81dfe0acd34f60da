"""Supervision of an index member: it never freezes silently, and silent workers go.

- Health: ``failure`` says why the member is unhealthy (None while healthy); ``/healthz``
  answers 503, ``kvwire_index_failed{reason}`` is 1, and ``kvwire index`` exits non-zero so
  an orchestrator restarts it. Reasons: the ingest or snapshot task ended, or snapshots failed
  ``snapshot_failure_limit`` times in a row.
- Snapshots run in their own task, never inside ingest: a store that hangs or fails costs
  snapshots (a longer replay after a restart), not freshness. A failed round is retried with
  exponential backoff; one that does not finish within ``snapshot_timeout_s`` counts as failed.
- Expiry: ranks silent past ``heartbeat_timeout_s`` are dropped (dead workers), checked a few
  times per timeout and only once caught up (before that, silence may be unread records).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from .apply import Applier

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, applier: Applier, heartbeat_timeout_s: float):
        self.applier = applier
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.failure: str | None = None
        self._failures: dict[str, str] = {}  # reason -> detail
        self.failed = asyncio.Event()
        self._expire_every = max(1.0, heartbeat_timeout_s / 4)
        self._last_expire = time.monotonic()

    # ------------------------------------------------------------ health

    @property
    def healthy(self) -> bool:
        return self.failure is None

    async def wait_failed(self) -> str:
        """Returns the reason once the member has become unhealthy."""
        await self.failed.wait()
        return self.failure or "unknown"

    def set_failure(self, reason: str, detail: str) -> None:
        if reason not in self._failures:
            log.error("index member unhealthy (%s): %s", reason, detail)
        self._failures[reason] = detail
        self.applier.metrics.failed.labels(reason).set(1)
        self.failure = "; ".join(f"{r}: {d}" for r, d in self._failures.items())
        self.failed.set()

    def clear_failure(self, reason: str) -> None:
        if self._failures.pop(reason, None) is not None:
            log.info("index member recovered from %s", reason)
            self.applier.metrics.failed.labels(reason).set(0)
            self.failure = "; ".join(f"{r}: {d}" for r, d in self._failures.items()) or None
            if self.failure is None:
                self.failed.clear()

    def watch(self, name: str, task: asyncio.Task, stopping: asyncio.Event) -> None:
        """A task that ends while the member is not stopping makes it unhealthy."""

        def ended(t: asyncio.Task) -> None:
            if stopping.is_set():
                return
            if t.cancelled():
                detail = f"{name} task cancelled"
            elif t.exception() is not None:
                detail = f"{name} task died: {t.exception()!r}"
            else:
                detail = f"{name} task returned"
            self.set_failure("ingest_task_dead" if name == "ingest" else "snapshot_task_dead", detail)

        task.add_done_callback(ended)

    # ------------------------------------------------------------ snapshots

    async def snapshot_loop(
        self,
        save: Callable[[], Any],
        may_save: Callable[[], bool],
        stopping: asyncio.Event,
        retry_s: float,
        retry_max_s: float,
        failure_limit: int,
        timeout_s: float,
    ) -> None:
        """Call ``save()`` (a coroutine) every 0.2 s while ``may_save()``, backing off on failure."""
        failures = 0  # failed attempts in a row
        retry_at = 0.0
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), 0.2)
                return
            except TimeoutError:
                pass
            if time.monotonic() < retry_at or not may_save():
                continue
            try:
                await asyncio.wait_for(save(), timeout_s)
            except Exception as e:
                failures += 1
                self.applier.metrics.snapshot_failures.inc()
                delay = min(retry_max_s, retry_s * 2 ** (failures - 1))
                retry_at = time.monotonic() + delay
                log.warning("snapshot failed (%d in a row), retrying in %.1fs: %r", failures, delay, e)
                if failures >= failure_limit:
                    self.set_failure("snapshots_failing", f"{failures} snapshot attempts failed: {e!r}")
            else:
                if failures:
                    log.info("snapshot succeeded after %d failure(s)", failures)
                failures = 0
                self.clear_failure("snapshots_failing")

    # ------------------------------------------------------------ expiry

    def expire_silent(self, caught_up: bool) -> None:
        """Drop ranks silent past the heartbeat timeout, when due and caught up."""
        now = time.monotonic()
        if now - self._last_expire >= self._expire_every and caught_up:
            self._last_expire = now
            self.applier.expire(time.time_ns() // 1000, int(self.heartbeat_timeout_s * 1e6))


__all__ = ["Supervisor"]
