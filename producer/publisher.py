"""Never-blocking Kafka publisher for KV-cache events.

Three parts, each on one side of the thread boundary:

- :mod:`.stream`: what an engine thread calls. :meth:`RankStream.publish` only appends to a
  bounded hand-off and returns; it never blocks and never raises.
- :mod:`.ledger`: per rank, on the loop thread: epoch, seq, the reset owed, and the carry of
  lost batches that the next record reports as ``gap``.
- :mod:`.sender`: the background thread, its asyncio loop and the idempotent producer: encoding,
  sending, retrying, heartbeats, and the unreachable gate.

Loss is never hidden: whatever cannot be sent (full buffer, cluster unreachable, unencodable
input) is counted and the next record of that rank carries it as ``gap``. This module ties the
parts together and is the import every caller uses.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections.abc import Callable

from kvwire.schemas.events import WorkerId

from .config import PublisherConfig
from .connect import HEADERS
from .ledger import RankLedger, StreamStats
from .sender import AckInfo, Sender
from .stream import Handoff, RankStream

__all__ = ["HEADERS", "AckInfo", "KafkaPublisher", "PublisherConfig", "RankStream", "StreamStats"]


class KafkaPublisher:
    """One background thread, one asyncio loop, one idempotent producer, many rank streams."""

    def __init__(
        self,
        config: PublisherConfig | None = None,
        *,
        on_ack: Callable[[AckInfo], None] | None = None,
    ) -> None:
        self.config = cfg = config or PublisherConfig()
        self._handoff = Handoff(cfg.queue_size)
        # Appended under _close_lock; the sender's loop reads it as it stands.
        self._ledgers: list[RankLedger] = []
        self._closed = False
        self._close_lock = threading.Lock()
        self._sender = Sender(cfg, self._handoff, self._ledgers, on_ack)
        self._sender.start()
        # The loop the sender runs on; tests stall it to overflow the hand-off for real.
        self._loop = self._sender.loop
        atexit.register(self.close)

    def stream(self, worker: WorkerId, source: str = "", *, state_known: bool = True) -> RankStream:
        """A new rank stream; its first record (a reset) is queued at once.

        state_known=False is for a source that starts beside an engine already running (a bridge
        over ZMQ): the announcement then carries a gap, so consumers distrust the rank from its
        first record until the source has established the engine's state (a replay opening a new
        epoch, or a clear) instead of crediting it, for an instant, with an empty cache."""
        st = RankStream(self._handoff, worker, source)
        with self._close_lock:
            self._ledgers.append(st.ledger)
        if not state_known:
            st.report_gap(1)
        # Announce the epoch at once: consumers drop what this rank held before, even if the
        # engine stays idle.
        st.enqueue_empty(time.time_ns() // 1000)
        self._handoff.wake()
        return st

    def stats(self) -> list[StreamStats]:
        with self._close_lock:
            return [led.stats() for led in self._ledgers]

    @property
    def unreachable(self) -> bool:
        return self._sender.unreachable

    def close(self, timeout: float | None = None) -> None:
        """Flush within the deadline, then stop the thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.close)
        budget = self.config.close_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, budget)
        # Shut the gate before the sender drains: nothing new may slip in behind the flush.
        self._handoff.accepting = False
        self._handoff.closing = True
        self._sender.stop(deadline)

    def __enter__(self) -> KafkaPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
