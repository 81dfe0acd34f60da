"""Per-rank stream state: epoch fencing, sequence dedup, gaps, expiry.

Every rank publishes ``(epoch, seq)``-stamped records. Kafka gives us them in
order per partition, but a log also holds duplicates (a producer retried
before idempotence), late records of a dead incarnation (a zombie flushing
after its replacement started), and holes (records lost upstream, or
truncated by retention). This module decides, per record, what the index
must do — it never touches the index itself.

Epochs are random, so "newer" cannot be read off their values: an epoch is
newer when it arrives after the current one; the epochs a rank has left are
remembered (boundedly) so their late records are recognised and ignored.
"""

from __future__ import annotations

import enum
from collections import deque

import msgspec

from kvwire.schemas.events import EventBatch

# Enough to outlast any realistic burst of restarts of one rank; an epoch
# older than this is ancient and its records are ignored anyway unless they
# carry a reset (which only a live producer sends first).
RETIRED_EPOCHS = 32


class Verdict(enum.Enum):
    APPLY = "apply"
    RESET = "reset"  # drop the rank's blocks, then apply
    DUPLICATE = "duplicate"
    STALE_EPOCH = "stale_epoch"


class RankState(msgspec.Struct):
    epoch: int
    last_seq: int
    trusted: bool
    last_seen_us: int
    retired: deque
    # Why the rank is untrusted, for operators (/v1/workers).
    untrusted_reason: str = ""
    records: int = 0
    gaps: int = 0


class RankTable:
    """Fencing decisions for every rank seen in the partitions we own."""

    def __init__(self) -> None:
        self.ranks: dict[tuple[str, int, int], RankState] = {}
        self.tp_size: dict[tuple[str, int], int] = {}

    def admit(self, batch: EventBatch) -> Verdict:
        w = batch.worker
        key = w.rank
        self.tp_size[w.worker] = w.tp_size
        st = self.ranks.get(key)
        if st is None:
            # First sight of a rank. Without a reset we joined its stream in
            # the middle (log truncated by retention, or a rank that predates
            # the snapshot we loaded): what it held before is unknown.
            st = RankState(batch.epoch, batch.seq, True, batch.ts_us, deque(maxlen=RETIRED_EPOCHS))
            self.ranks[key] = st
            if not batch.reset:
                self._distrust(st, "joined mid-stream (no reset record seen)")
            self._note(st, batch)
            return Verdict.RESET
        if batch.epoch != st.epoch:
            if batch.epoch in st.retired:
                return Verdict.STALE_EPOCH
            st.retired.append(st.epoch)
            st.epoch, st.last_seq, st.trusted, st.untrusted_reason = batch.epoch, batch.seq, True, ""
            if not batch.reset:
                self._distrust(st, "new epoch without its reset record")
            self._note(st, batch)
            return Verdict.RESET
        if batch.seq <= st.last_seq:
            return Verdict.DUPLICATE
        if batch.reset:
            # A producer only resets at seq 0; a reset mid-epoch is a fresh
            # start of the same incarnation (e.g. the bridge saw the engine
            # restart without a new process): honour it.
            st.trusted, st.untrusted_reason = True, ""
            st.last_seq = batch.seq
            self._note(st, batch)
            return Verdict.RESET
        if batch.seq != st.last_seq + 1:
            self._distrust(st, f"records {st.last_seq + 1}..{batch.seq - 1} missing from the log")
        st.last_seq = batch.seq
        self._note(st, batch)
        return Verdict.APPLY

    def _note(self, st: RankState, batch: EventBatch) -> None:
        st.records += 1
        st.last_seen_us = max(st.last_seen_us, batch.ts_us)
        if batch.gap:
            st.gaps += batch.gap
            self._distrust(st, f"producer lost {batch.gap} batch(es) before seq {batch.seq}")

    @staticmethod
    def _distrust(st: RankState, why: str) -> None:
        st.trusted = False
        st.untrusted_reason = why

    def worker_trusted(self, worker: tuple[str, int]) -> bool:
        """A worker is trusted when every one of its ranks we know is."""
        ranks = [s for (i, d, _), s in self.ranks.items() if (i, d) == worker]
        n = self.tp_size.get(worker, 1)
        return len(ranks) >= n and all(s.trusted for s in ranks)

    def untrusted_workers(self) -> set[tuple[str, int]]:
        workers = {(i, d) for (i, d, _) in self.ranks}
        return {w for w in workers if not self.worker_trusted(w)}

    def expired(self, now_us: int, timeout_us: int) -> list[tuple[str, int, int]]:
        return [k for k, s in self.ranks.items() if now_us - s.last_seen_us > timeout_us]

    def forget(self, rank: tuple[str, int, int]) -> None:
        self.ranks.pop(rank, None)

    def forget_worker(self, worker: tuple[str, int]) -> None:
        for k in [k for k in self.ranks if k[:2] == worker]:
            del self.ranks[k]
        self.tp_size.pop(worker, None)
