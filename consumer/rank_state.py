"""Per-rank stream state: epoch fencing, sequence dedup, gaps, trust, expiry.

Every rank publishes ``(epoch, seq)``-stamped records. Kafka gives us them in
order per partition, but a log also holds duplicates (a producer retried
before idempotence), late records of a dead incarnation (a zombie flushing
after its replacement started), and holes (records lost upstream, or
truncated by retention). This module decides, per record, what the index
must do — it never touches the index itself.

Epochs are random, so "newer" cannot be read off their values: an epoch is
newer when it arrives after the current one; the epochs a rank has left are
remembered (boundedly) so their late records are recognised and ignored.

Trust: a rank is untrusted from the moment its view may be incomplete (joined
mid-stream, a new epoch without its reset, a seq hole, a producer gap, a record
that could not be applied) until a point where its full state is known again:
a reset record, or an AllBlocksCleared from that rank (it then holds nothing;
events after the clear in the same record apply normally, and a gap the same
record carries happened before it). A worker is trusted when all its
``tp_size`` ranks are.

The state and the rules live in the Rust core (``rust/src/fence.rs``), where the
ingest's one-call-per-poll pipeline fences each record; this is its Python face.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from kvwire import _core
from kvwire.schemas.events import EventBatch

# Enough to outlast any realistic burst of restarts of one rank; an epoch
# older than this is ancient and its records are ignored anyway unless they
# carry a reset (which only a live producer sends first).
RETIRED_EPOCHS: int = _core.RETIRED_EPOCHS  # the fence's bound (rust/src/fence.rs), its one home


# APPLY, RESET (drop the rank's blocks, then apply), DUPLICATE, STALE_EPOCH: the core's own
# enum (rust/src/fence.rs), so a verdict crosses the boundary as itself. Compare with ==:
# the core hands out a new object per verdict.
Verdict = _core.Verdict


class RankState(msgspec.Struct):
    epoch: int
    last_seq: int
    trusted: bool
    last_seen_us: int
    retired: deque[int]
    # Why the rank is untrusted, for operators (/v1/workers).
    untrusted_reason: str = ""
    records: int = 0
    gaps: int = 0
    # Its latest record came from a source that cannot observe removals.
    approximate: bool = False
    # The served model its records name ("" until one does): Dynamo's model_name selects by it.
    model: str = ""

    @classmethod
    def of(cls, r: Any) -> RankState:
        """From a row holding these fields by name: the core's ``Fence.ranks()`` rows, or a
        snapshot's ``RankRecord``."""
        return cls(
            r.epoch,
            r.last_seq,
            r.trusted,
            r.last_seen_us,
            deque(r.retired, maxlen=RETIRED_EPOCHS),
            r.untrusted_reason,
            r.records,
            r.gaps,
            r.approximate,
            r.model,
        )


class RankTable:
    """Fencing decisions for every rank seen in the partitions we own.

    ``ranks`` and ``tp_size`` are read-only views built on each access; change
    state through ``admit``, ``restore``, ``forget`` and ``forget_worker``."""

    def __init__(self) -> None:
        self.core = _core.Fence()

    def admit(self, batch: EventBatch) -> Verdict:
        return self.core.admit(batch)

    @property
    def ranks(self) -> dict[tuple[str, int, int], RankState]:
        return {(r.instance_id, r.dp_rank, r.tp_rank): RankState.of(r) for r in self.core.ranks()}

    @property
    def tp_size(self) -> dict[tuple[str, int], int]:
        return {(i, d): t for i, d, t in self.core.tp_sizes()}

    def restore(self, rank: tuple[str, int, int], st: RankState, tp_size: int) -> None:
        """Install a rank's state as a snapshot recorded it."""
        self.core.restore(rank, tp_size, st)

    def worker_trusted(self, worker: tuple[str, int]) -> bool:
        """A worker is trusted when every one of its ranks we know is, and we know all of them."""
        return bool(self.core.worker_trusted(worker[0], worker[1]))

    def untrusted_workers(self) -> set[tuple[str, int]]:
        return {(i, d) for i, d in self.core.untrusted_workers()}

    def approximate_workers(self) -> set[tuple[str, int]]:
        """Workers one of whose ranks' latest record came from a source that cannot
        observe removals (its ``source`` ends in "/approximate"): their blocks may
        outlive the engine's, so what credits them is marked approximate."""
        return {(i, d) for i, d in self.core.approximate_workers()}

    def known_workers(self) -> set[tuple[str, int]]:
        return {(i, d) for i, d in self.core.workers()}

    def expired(self, now_us: int, timeout_us: int) -> list[tuple[str, int, int]]:
        return [(i, d, t) for i, d, t in self.core.expired(now_us, timeout_us)]

    def forget(self, rank: tuple[str, int, int]) -> None:
        self.core.forget(*rank)

    def forget_worker(self, worker: tuple[str, int]) -> None:
        self.core.forget_worker(worker[0], worker[1])
