"""What every engine source publishes into: the shape of the publisher's RankStream.

Sources (ZMQ bridge, KV connector, LMCache poller) depend on this protocol only,
so they are tested against an in-memory sink and run against the Kafka one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvwire.schemas.events import KVEvent


@runtime_checkable
class EventSink(Protocol):
    def publish(self, events: Sequence[KVEvent], engine_ts: float | None = None) -> bool:
        """Hand over one batch; never blocks, never raises. False = dropped (and counted)."""
        ...

    def new_epoch(self) -> object:
        """The engine restarted: what the rank held before is gone. (RankStream returns the new
        epoch id; sources ignore it.)"""
        ...

    def report_gap(self, n: int) -> None:
        """n upstream batches were lost; the next record must say so."""
        ...
