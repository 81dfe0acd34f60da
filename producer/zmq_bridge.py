"""Bridge: a vLLM ``ZmqEventPublisher`` stream -> one kvwire rank stream.

vLLM's stream has a per-process sequence number and a replay socket but no
incarnation id, and PUB/SUB drops silently (slow joiner, HWM). A routing index
must never credit a worker with blocks it does not hold, so the bridge keeps
one rule: **the rank is trusted only while the bridge knows the engine's whole
state**, and it says so in the contract's terms, with no fencing rule beyond
"a gap distrusts the rank until its next reset":

* *Known* means every batch of the engine process since seq 0 (or since an
  ``AllBlocksCleared``) reached the stream, in order. The bridge establishes it
  by **syncing**: it asks the replay socket for everything from seq 0; if the
  answer starts at 0 it opens a new epoch (the reset record drops whatever the
  index held) and publishes the whole replay in it.
* *Unknown* is published at once as a record carrying a gap, which makes the
  index stop crediting the worker: when the bridge starts (until its first
  sync), when the engine's connection drops (ZMQ socket monitor), when the
  engine stops answering (below), when a batch is lost or undecodable, and
  when the replay buffer no longer starts at 0 (the engine ran longer than
  vLLM's ``buffer_steps``).
* An ``AllBlocksCleared`` makes the engine's state known again (it is empty),
  whatever was lost before: the bridge opens a new epoch at the clear and
  publishes the rest of the batch in it.
* Liveness: an idle engine publishes nothing, so silence alone proves
  nothing. After ``liveness_interval_s`` without a frame the bridge asks the
  replay socket for what follows its last batch. vLLM's publisher thread
  answers within ~0.1 s (its queue poll), which also fills a lost tail. No
  answer within ``replay_timeout_s`` marks the engine down (unknown). A closed
  connection is seen at once by the socket monitor. So a dead or hung engine
  stops being credited within ``liveness_interval_s + replay_timeout_s`` at
  most; the publisher's heartbeats keep the worker *listed*, untrusted.
* After a disconnect the bridge syncs again when the engine reconnects (or its
  next frame arrives), so a restarted engine is trusted again with its exact
  state, and the same engine after a network blip too.
* Without a replay endpoint the bridge cannot sync: a worker becomes trusted
  only from a frame with seq 0 (a fresh engine seen from its start) or a clear.

The ZMQ stream is emitted by the engine core after TP aggregation, so it is
one rank: tp_rank 0 of tp_size 1 for its (instance, dp_rank) worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

from .sink import EventSink
from .vllm_wire import WireError, decode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)

_MONITORED = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


@dataclass
class BridgeConfig:
    zmq_endpoint: str
    replay_endpoint: str | None = None
    # vLLM publishes with topic "" by default; SUB filters by prefix.
    zmq_topic: str = ""
    # A replay that has not finished by then is abandoned: the engine counts as not answering.
    replay_timeout_s: float = 5.0
    # How often the receive loop looks at the stop flag.
    poll_interval_ms: int = 100
    expected_dp_rank: int | None = None
    # Engine silent this long: ask its replay socket whether it is alive (see module doc).
    liveness_interval_s: float = 2.0
    # Replayed batches go out merged into records of about this many bytes of events: a sync can
    # replay vLLM's whole buffer (10,000 batches), which must neither overflow the publisher's
    # bounded queue nor exceed a record's size limit.
    sync_record_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.replay_timeout_s <= 0 or self.liveness_interval_s <= 0:
            raise ValueError("replay_timeout_s and liveness_interval_s must be > 0")


@dataclass
class BridgeStats:
    frames: int = 0
    batches: int = 0
    events: int = 0
    bad_frames: int = 0
    duplicates: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_timeouts: int = 0
    lost_batches: int = 0
    restarts: int = 0
    syncs: int = 0
    disconnects: int = 0
    unknown: int = 0  # times the rank was published as untrusted
    clears: int = 0  # epochs opened at an AllBlocksCleared
    dp_rank_mismatches: int = 0
    dropped_by_sink: int = 0
    last_error: str = ""
    errors: dict[str, int] = field(default_factory=dict)


def _event_bytes(ev: KVEvent) -> int:
    if isinstance(ev, BlockStored):
        return 64 + 4 * len(ev.token_ids) + 12 * len(ev.block_hashes)
    if isinstance(ev, BlockRemoved):
        return 32 + 12 * len(ev.block_hashes)
    return 8


class ZmqBridge:
    def __init__(self, cfg: BridgeConfig, sink: EventSink, ctx: zmq.asyncio.Context | None = None):
        self.cfg = cfg
        self.sink = sink
        self.stats = BridgeStats()
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        # Next engine seq the rank stream needs; None until the first frame or sync.
        self._expected: int | None = None
        # Highest seq delivered from the live socket since the last sync: one process's live
        # seqs only increase, so a lower one means a new process.
        self._last_live: int = -1
        # The stream holds the engine's whole state (see module doc); and whether the index has
        # been told that it does not, since the last epoch.
        self.known = False
        self._said_unknown = False
        self._need_sync = True
        self._contact = time.monotonic()
        # Events merged for one record, and the engine time of the last batch among them.
        self._pending: list[KVEvent] = []
        self._pending_bytes = 0
        self._pending_ts: float | None = None
        self.subscribed = asyncio.Event()

    # ------------------------------------------------------------ sockets

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.zmq_topic.encode())
        self._monitor = sub.get_monitor_socket(_MONITORED)
        # vLLM binds with "*" and connects otherwise; the bridge mirrors it.
        if "*" in self.cfg.zmq_endpoint:
            sub.bind(self.cfg.zmq_endpoint)
        else:
            sub.connect(self.cfg.zmq_endpoint)
        self._sub = sub
        return sub, self._monitor

    def _new_dealer(self) -> zmq.asyncio.Socket:
        assert self.cfg.replay_endpoint is not None  # only replays open one
        d = self._ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.cfg.replay_endpoint)
        return d

    def close(self) -> None:
        if self._sub is not None and self._monitor is not None:
            try:
                self._sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for s in (self._monitor, self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._sub = self._dealer = self._monitor = None

    # ------------------------------------------------------------ main loop

    async def run(self, stop: asyncio.Event) -> None:
        sub, monitor = self._open()
        self.subscribed.set()
        try:
            self._mark_unknown("bridge started: the engine's state is not read yet")
            if self.cfg.replay_endpoint:
                await self._sync("bridge started")
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while not stop.is_set():
                ready = dict(await poller.poll(self.cfg.poll_interval_ms))
                try:
                    if monitor in ready:
                        await self._on_monitor(parse_monitor_message(await monitor.recv_multipart()))
                    if sub in ready:
                        await self._on_live(await sub.recv_multipart())
                    elif time.monotonic() - self._contact >= self.cfg.liveness_interval_s:
                        await self._check_alive()
                except Exception as e:  # a bridge bug must not end the stream
                    self._bad("internal", f"{type(e).__name__}: {e}")
                    log.exception("bridge step failed")
                    self._mark_unknown("bridge error")
                    self._need_sync = True
        finally:
            self.close()

    def _bad(self, kind: str, why: str) -> None:
        self.stats.bad_frames += 1
        self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        self.stats.last_error = why
        log.warning("bad frame (%s): %s", kind, why)

    # ------------------------------------------------------------ trust

    def _mark_unknown(self, why: str) -> None:
        """Publish at once that the rank's state is unknown: a record with a gap."""
        if self._said_unknown:
            return  # the index distrusts the rank until the next epoch already
        self.known = False
        self._said_unknown = True
        self.stats.unknown += 1
        log.info("engine state unknown: %s", why)
        self.sink.report_gap(1)
        self._publish_now(())

    def _open_epoch(self, why: str) -> None:
        """The engine's whole state from here on is known: a new epoch (reset) starts it."""
        self._flush()
        self.sink.new_epoch()
        self.known = True
        self._said_unknown = False
        log.info("engine state known: %s", why)

    def _lose(self, n: int, why: str) -> None:
        self._flush()
        self.stats.lost_batches += n
        self.known = False
        self._said_unknown = True
        log.warning("%d engine batch(es) lost: %s", n, why)
        self.sink.report_gap(n)
        self._publish_now(())  # the gap reaches the index now, not with the next batch
        if self._expected is not None:
            self._expected += n

    async def _on_monitor(self, ev: Mapping[str, Any]) -> None:
        kind = ev["event"]
        if kind == zmq.EVENT_DISCONNECTED:
            self.stats.disconnects += 1
            self._need_sync = True
            self._mark_unknown("engine disconnected")
        elif self._need_sync and self.cfg.replay_endpoint:
            await self._sync("engine connected")

    async def _check_alive(self) -> None:
        self._contact = time.monotonic()  # one probe per interval, answered or not
        if not self.cfg.replay_endpoint:
            return
        if self._need_sync:
            await self._sync("retry")
            return
        start = self._expected if self._expected is not None else 0
        items = await self._replay_all(start)
        if items is None:
            self._need_sync = True
            self._mark_unknown("engine did not answer its replay socket")
            return
        if items:
            self._deliver_many(items)

    async def _sync(self, why: str) -> None:
        """Read the engine's whole replay buffer and publish it as its state (module doc)."""
        items = await self._replay_all(0)
        if items is None:
            self._need_sync = True
            self._mark_unknown(f"{why}: the replay socket did not answer")
            return
        self.stats.syncs += 1
        self._need_sync = False
        self._last_live = -1
        first = items[0][0] if items else 0
        if first == 0:
            self._open_epoch(f"{why}: replayed {len(items)} batch(es) from seq 0")
        else:
            self._mark_unknown(f"{why}: the engine's replay buffer starts at seq {first}, not 0")
        self._expected = first
        self._deliver_many(items)

    # ------------------------------------------------------------ live frames

    async def _on_live(self, frames: list[bytes]) -> None:
        self.stats.frames += 1
        self._contact = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            # No trustworthy seq: drop it; the next good frame (or liveness probe) reveals the hole.
            self._bad("framing", f"{len(frames)} frames, seq frame of {len(frames[1]) if len(frames) > 1 else 0} bytes")
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        if self._last_live >= 0 and seq <= self._last_live:
            self.stats.restarts += 1
            log.info("engine restart: live seq %d after %d", seq, self._last_live)
            self._need_sync = True
            if not self.cfg.replay_endpoint:
                self._last_live = -1
                self._open_epoch("engine restarted")
                self._expected = 0
        if self._need_sync and self.cfg.replay_endpoint:
            await self._sync("engine frame after a disconnect")
        if self._expected is None:
            # No replay (socket or answer): the state is known only if this is the first batch.
            if seq == 0:
                self._open_epoch("first frame is the engine's first batch")
            self._expected = seq
        if seq < self._expected:
            self.stats.duplicates += 1  # already delivered by a replay
            return
        self._last_live = seq
        if seq > self._expected:
            await self._fill(self._expected, seq)
            if seq < self._expected:
                self.stats.duplicates += 1
                return
            if seq > self._expected:
                self._lose(seq - self._expected, "neither the live socket nor replay had them")
        self._deliver_many([(seq, payload)])

    def _deliver_many(self, items: Sequence[tuple[int, bytes]]) -> None:
        """Deliver contiguous-or-not (seq, payload)s in order, merging them into records."""
        for seq, payload in items:
            if self._expected is not None and seq < self._expected:
                continue
            if self._expected is not None and seq > self._expected:
                self._lose(seq - self._expected, "replay no longer had them")
            self._expected = seq + 1
            try:
                batch = decode_batch(payload)
            except WireError as e:
                # The batch is lost to the rank's view as surely as a dropped frame.
                self._bad(type(e).__name__, e.reason)
                self._expected = seq
                self._lose(1, "undecodable batch")
                continue
            if (
                self.cfg.expected_dp_rank is not None
                and batch.data_parallel_rank is not None
                and batch.data_parallel_rank != self.cfg.expected_dp_rank
            ):
                self.stats.dp_rank_mismatches += 1
            self.stats.batches += 1
            self.stats.events += len(batch.events)
            self._add(batch.events, batch.ts)
        self._flush()

    def _add(self, events: Sequence[KVEvent], ts: float | None) -> None:
        events = list(events)
        for i in range(len(events) - 1, -1, -1):
            if isinstance(events[i], AllBlocksCleared):
                # The clear wipes what came before it, so after it the engine's state is known
                # (empty) whatever was lost earlier: a new epoch starts there.
                self._pending, self._pending_bytes, self._pending_ts = [], 0, None
                self.stats.clears += 1
                self._open_epoch("AllBlocksCleared")
                events = events[i:]
                break
        for ev in events:
            self._pending.append(ev)
            self._pending_bytes += _event_bytes(ev)
        self._pending_ts = ts
        if self._pending_bytes >= self.cfg.sync_record_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._pending or self._pending_ts is not None:
            events, ts = self._pending, self._pending_ts
            self._pending, self._pending_bytes, self._pending_ts = [], 0, None
            self._publish_now(events, ts)

    def _publish_now(self, events: Sequence[KVEvent], engine_ts: float | None = None) -> None:
        if not self.sink.publish(events, engine_ts=engine_ts):
            # The publisher counted it and its next record carries the gap.
            self.stats.dropped_by_sink += 1
            self.known = False

    # ------------------------------------------------------------ replay

    async def _replay_all(self, start: int) -> list[tuple[int, bytes]] | None:
        """Every (seq, payload) the replay socket holds from ``start``; None if it did not answer."""
        self.stats.replays += 1
        if self._dealer is None:
            self._dealer = self._new_dealer()
        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.cfg.replay_timeout_s
        out: list[tuple[int, bytes]] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(int(left * 1000) + 1):
                # A late answer on this socket would be mistaken for the next replay's.
                self.stats.replay_timeouts += 1
                dealer.close(linger=0)
                self._dealer = None
                log.warning("replay from %d timed out", start)
                return None
            frames = await dealer.recv_multipart()
            # [b"", topic, seq, payload] since vLLM 0.26; [b"", seq, payload] before.
            if len(frames) == 4:
                seq_b, payload = frames[2], frames[3]
            elif len(frames) == 3:
                seq_b, payload = frames[1], frames[2]
            else:
                self._bad("replay-framing", f"{len(frames)} frames")
                continue
            if seq_b == END_SEQ:
                self._contact = time.monotonic()
                self.stats.replayed_batches += len(out)
                return out
            if len(seq_b) != 8:
                self._bad("replay-framing", f"seq frame of {len(seq_b)} bytes")
                continue
            out.append((int.from_bytes(seq_b, "big"), payload))

    async def _fill(self, start: int, upto: int) -> None:
        """Deliver what the replay socket still buffers of [start, upto)."""
        if not self.cfg.replay_endpoint:
            return
        items = await self._replay_all(start)
        if items is None:
            return  # the caller reports what is still missing
        self._deliver_many([(s, p) for s, p in items if s < upto])


__all__ = ["END_SEQ", "BridgeConfig", "BridgeStats", "ZmqBridge"]
