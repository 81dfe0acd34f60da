"""Bridge: a vLLM ``ZmqEventPublisher`` stream -> one kvwire rank stream.

vLLM's stream has a per-process sequence number and a replay socket but no
incarnation id, and PUB/SUB drops silently (slow joiner, HWM). A durable log
needs to know when its view of the engine is complete, so the bridge turns
what the sequence numbers reveal into the contract's terms:

* a hole in the sequence is filled from the replay socket; whatever replay
  cannot supply is reported with ``report_gap(n)``;
* the live sequence going backwards means a new publisher process, i.e. an
  engine restart: ``new_epoch()`` (the next record carries ``reset``);
* the bridge joining late (first seq > 0) is a hole from 0.

The ZMQ stream is emitted by the engine core after TP aggregation, so it is
one rank: tp_rank 0 of tp_size 1 for its (instance, dp_rank) worker.

vLLM's wire has no incarnation id, and a restarted engine may publish more
batches than the old one had before the SUB socket reconnects, so its seq need
not go backwards. After the SUB socket saw its publisher disconnect, the first
frame is therefore checked against the replay buffer: the batch last delivered
must still be there byte for byte if the publisher is the same process. A
different payload means a new process (restart); no answer either way is
treated as a hole (reported as a gap: the consumer distrusts the rank rather
than believe a reset that may not have happened).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .sink import EventSink
from .vllm_wire import WireError, decode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class BridgeConfig:
    zmq_endpoint: str
    replay_endpoint: str | None = None
    # vLLM publishes with topic "" by default; SUB filters by prefix.
    zmq_topic: str = ""
    # A replay that has not finished by then is abandoned; its missing part becomes a gap.
    replay_timeout_s: float = 5.0
    # How often the receive loop looks at the stop flag.
    poll_interval_ms: int = 100
    expected_dp_rank: int | None = None


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
    dp_rank_mismatches: int = 0
    dropped_by_sink: int = 0
    last_error: str = ""
    errors: dict[str, int] = field(default_factory=dict)


class ZmqBridge:
    def __init__(self, cfg: BridgeConfig, sink: EventSink, ctx: zmq.asyncio.Context | None = None):
        self.cfg = cfg
        self.sink = sink
        self.stats = BridgeStats()
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        # Next seq the rank stream needs; None until the first frame.
        self._expected: int | None = None
        # Highest seq seen on the live socket: live frames of one process only increase.
        self._last_live: int = -1
        # (seq, payload) of the batch last delivered: the incarnation check's witness.
        self._last_delivered: tuple[int, bytes] | None = None
        self._suspect_restart = False
        self._monitor: zmq.asyncio.Socket | None = None
        self.subscribed = asyncio.Event()

    # ------------------------------------------------------------ sockets

    def _open(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.cfg.zmq_topic.encode())
        # vLLM binds with "*" and connects otherwise; the bridge mirrors it.
        if "*" in self.cfg.zmq_endpoint:
            sub.bind(self.cfg.zmq_endpoint)
        else:
            sub.connect(self.cfg.zmq_endpoint)
        self._sub = sub
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    def _new_dealer(self) -> zmq.asyncio.Socket:
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
        self._open()
        self.subscribed.set()
        try:
            poller = zmq.asyncio.Poller()
            poller.register(self._sub, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while not stop.is_set():
                ready = dict(await poller.poll(self.cfg.poll_interval_ms))
                if self._monitor in ready:
                    ev = parse_monitor_message(await self._monitor.recv_multipart())
                    if ev["event"] == zmq.EVENT_DISCONNECTED and self._last_delivered is not None:
                        self._suspect_restart = True
                if self._sub not in ready:
                    continue
                frames = await self._sub.recv_multipart()
                try:
                    await self._on_live(frames)
                except Exception as e:  # a bridge bug must not end the stream
                    self._bad("internal", f"{type(e).__name__}: {e}")
                    log.exception("bridge failed on a frame")
        finally:
            self.close()

    def _bad(self, kind: str, why: str) -> None:
        self.stats.bad_frames += 1
        self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        self.stats.last_error = why
        log.warning("bad frame (%s): %s", kind, why)

    async def _on_live(self, frames: list[bytes]) -> None:
        self.stats.frames += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            # No trustworthy seq: drop it; the next good frame reveals the hole.
            self._bad("framing", f"{len(frames)} frames, seq frame of {len(frames[1]) if len(frames) > 1 else 0} bytes")
            return
        seq = int.from_bytes(frames[1], "big")
        payload = frames[2]
        restarted = seq <= self._last_live  # one process's live seqs only increase
        if not restarted and self._suspect_restart:
            restarted = await self._probe_restart()
        self._suspect_restart = False
        if restarted:
            self.stats.restarts += 1
            log.info("engine restart: live seq %d after %d", seq, self._last_live)
            self.sink.new_epoch()
            self._expected = 0
            self._last_delivered = None
        self._last_live = seq
        if self._expected is None:
            self._expected = 0  # joined late: everything before `seq` is a hole to fill
        if seq < self._expected:
            self.stats.duplicates += 1  # already delivered by a replay
            return
        if seq > self._expected:
            await self._fill(self._expected, seq)
            if seq < self._expected:
                self.stats.duplicates += 1
                return
            if seq > self._expected:
                self._lose(seq - self._expected)
        self._deliver(seq, payload)

    def _lose(self, n: int) -> None:
        self.stats.lost_batches += n
        self.sink.report_gap(n)
        self._expected += n

    def _deliver(self, seq: int, payload: bytes) -> None:
        self._expected = seq + 1
        self._last_delivered = (seq, payload)
        try:
            batch = decode_batch(payload)
        except WireError as e:
            # The batch is lost to the rank's view as surely as a dropped frame.
            self._bad(type(e).__name__, e.reason)
            self.stats.lost_batches += 1
            self.sink.report_gap(1)
            return
        if (
            self.cfg.expected_dp_rank is not None
            and batch.data_parallel_rank is not None
            and batch.data_parallel_rank != self.cfg.expected_dp_rank
        ):
            self.stats.dp_rank_mismatches += 1
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        if not self.sink.publish(batch.events, engine_ts=batch.ts):
            self.stats.dropped_by_sink += 1

    # ------------------------------------------------------------ replay

    async def _replay(self, start: int):
        """Yield (seq, payload) the replay socket returns from ``start``; None on timeout."""
        self.stats.replays += 1
        if self._dealer is None:
            self._dealer = self._new_dealer()
        dealer = self._dealer
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        deadline = time.monotonic() + self.cfg.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(int(left * 1000) + 1):
                # A late answer on this socket would be mistaken for the next replay's.
                self.stats.replay_timeouts += 1
                dealer.close(linger=0)
                self._dealer = None
                log.warning("replay from %d timed out", start)
                yield None
                return
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
                return
            if len(seq_b) != 8:
                self._bad("replay-framing", f"seq frame of {len(seq_b)} bytes")
                continue
            yield int.from_bytes(seq_b, "big"), payload

    async def _probe_restart(self) -> bool:
        """After a disconnect: is the publisher a new process? See module doc."""
        if not self.cfg.replay_endpoint or self._last_delivered is None:
            return False
        last_seq, last_payload = self._last_delivered
        verdict = False
        async for item in self._replay(last_seq):
            if item is None:
                return False
            seq, payload = item
            if seq == last_seq:
                verdict = payload != last_payload
            # keep reading to the end marker so the next replay starts clean
        return verdict

    async def _fill(self, start: int, upto: int) -> None:
        """Deliver what the replay socket still buffers of [start, upto)."""
        if not self.cfg.replay_endpoint:
            return
        async for item in self._replay(start):
            if item is None:
                return
            seq, payload = item
            if seq < self._expected or seq >= upto:
                continue  # delivered already, or the live socket will bring it
            if seq > self._expected:
                self._lose(seq - self._expected)
            self.stats.replayed_batches += 1
            self._deliver(seq, payload)


__all__ = ["END_SEQ", "BridgeConfig", "BridgeStats", "ZmqBridge"]
