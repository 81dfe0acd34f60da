"""vLLM-format KV-event streams served from the log (``kvwire index --event-streams``).

Routers that keep their own index (vllm-router ``--policy kv_aware``, Dynamo's indexer, llm-d)
subscribe to each engine's ZMQ PUB socket and ask its ROUTER socket for history. This module
serves the same two sockets per worker (instance_id, dp_rank), fed from the log: a router
changes an endpoint and reads kvwire's truth about the worker instead of one engine's
10,000-batch ring.

What a subscriber sees is the index's state of the worker, not a copy of raw records:
- the blocks the worker holds per (medium, group) as the index counts them (every TP rank holds
  it, a block held while any physical copy is), asked of the index after each applied slice
  (``consumer.stream_table``), sent as the difference from what the stream said before: stores
  parent before child, removals child before parent (as vLLM evicts; Dynamo's tree drops a
  block's descendants once nobody holds it);
- while the fence does not trust the worker (``RankTable.worker_trusted``: a gap, a new epoch
  without its reset, expiry), one ``AllBlocksCleared`` and nothing more; once it trusts it
  again, the worker's whole known state. A router under-credits while kvwire knows nothing and
  never over-credits;
- seqs are contiguous per stream and count batches with content. Seq 0 is an
  ``AllBlocksCleared`` ("nothing yet"), seq 1 the worker's first state. A member's stream starts
  when the member first sees the worker and is not an engine's: seqs restart when the member
  restarts, as an engine's do (both clients then start over);
- every ``heartbeat_s`` an idle stream re-sends its last seq with no events: both clients ask
  for history only when a live batch shows a gap, so a router that subscribes while a worker is
  idle must see a seq beyond what it has (the first one a late joiner sees is above 0), and one
  that has everything skips a seq it already applied. A heartbeat takes no seq of its own, so
  idle time does not lengthen replays;
- replay: a request for seq s is answered with the buffered batches from s on while s is in the
  buffer. Older (any age: a router restarted after a million batches) gets the whole current
  state (``AllBlocksCleared``, then every held block, parents first, in batches of at most
  ``MAX_BATCH_EVENTS``) under the seqs from s on, empty batches for the other seqs up to the
  last one sent, then seq -1 as vLLM ends a replay. vllm-router 0.1.17 drops a replay whose
  seqs do not run on from the one it asked for ("noncontiguous seq"), and then does not credit
  the worker: hence one frame per missed seq, sent ``REPLAY_FRAMES_PER_TICK`` at a time. The
  state is taken when the request arrives, so the subscriber only ever grows towards it: it
  never re-applies buffered history on top of it, which would credit blocks stored and since
  removed, and drop blocks removed and since stored again, until the replay's end (a restarted
  vllm-router routed by those passing states for as long as its replay took);
- frames go out on vLLM's default topic ``""``, live and on replay (vllm-router 0.1.17 drops
  any other).

Ports: from ``port`` upward, PUB then ROUTER, two per worker in the order the member first sees
them; a port in use is skipped. A worker keeps its ports while the member lives: an expired or
dropped worker's stream stays listed, cleared (untrusted), and resumes if the worker returns.

ZMQ here has no authentication and no encryption: anyone who reaches a port reads the
worker's blocks (token ids included). Bind it where only routers reach (the default host is
127.0.0.1).

All of it runs on ingest's loop: per slice the work is the blocks the slice named; a clear, a
regained trust and a compacted replay cost the worker's held blocks once. That work is Python
(the reference decoder, keys, one core call and one batch per record): measured on one core
with 8-block records, ingest with streams applied ~44k blocks/s against ~1.8M without, so a
member serving streams for a busy fleet lags behind one that does not (the per-block part
belongs in the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvwire.schemas.events import EventBatch

from .apply import Applier
from .index import PrefixIndex
from .stream_table import Block, Change, Place, StreamTable, Worker
from .vllm_events import AllBlocksCleared, Batch, BlockRemoved, BlockStored, Event, encode
from .worker_ids import worker_id

log = logging.getLogger(__name__)

TOPIC = b""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_PORT = 5557
# As vLLM's publisher: a router may ask for this many batches back before it gets a compaction.
DEFAULT_BUFFER = 10_000
HEARTBEAT_S = 0.5
TICK_S = 0.05
# A whole replay must fit a socket's queue, or ZMQ drops its tail silently.
HWM = 1_000_000
MAX_PORT_TRIES = 1000
# Replay frames sent per stream per tick: a long answer goes out over several ticks.
REPLAY_FRAMES_PER_TICK = 20_000
# A whole state goes out in batches of at most this many events and token ids, and a chain in
# events of at most this many blocks: vllm-router 0.1.17 refuses a batch over its event limit or
# 16 MiB, and a smaller batch is less for any client to hold at once.
MAX_BATCH_EVENTS = 256
MAX_BATCH_TOKENS = 256 * 1024
MAX_RUN_BLOCKS = 512


@dataclass
class _Stream:
    worker: Worker
    worker_id: int
    port: int
    pub: zmq.Socket
    replay: zmq.Socket
    buffer: deque[tuple[int, bytes]]
    seq: int = 0
    # Told AllBlocksCleared since the fence stopped trusting the worker (nothing sent after).
    cleared: bool = False
    started: bool = False
    last_send: float = 0.0
    # Replays being answered: (requester, frames still to send).
    replays: deque[tuple[bytes, Iterator[tuple[int, bytes]]]] = field(default_factory=deque)

    def heartbeat(self) -> None:
        """An empty batch under the last seq sent: it shows a subscriber that has missed
        something (or joined late) a seq beyond what it has, and one that has everything a
        seq it already applied, which both clients skip. It takes no seq of its own: a stream's
        seqs count batches with content, and a replay answers one frame per seq."""
        payload = encode(Batch(time.time(), [], self.worker[1]))
        self.pub.send_multipart((TOPIC, (self.seq - 1).to_bytes(8, "big"), payload))
        self.last_send = time.monotonic()

    def send(self, events: list[Event]) -> None:
        payload = encode(Batch(time.time(), events, self.worker[1]))
        seq = self.seq
        self.seq += 1
        self.pub.send_multipart((TOPIC, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))
        self.last_send = time.monotonic()


class EventStreams:
    """The streams of every worker the member indexes; an ``AppliedObserver`` of its Applier."""

    def __init__(
        self,
        applier: Applier[PrefixIndex],
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        buffer_batches: int = DEFAULT_BUFFER,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.applier = applier
        self.host = host
        self.base_port = port
        self.buffer_batches = buffer_batches
        self.heartbeat_s = heartbeat_s
        self.table = StreamTable(applier.index, applier.schema_ids)
        self._ctx = zmq.Context()
        self._streams: dict[Worker, _Stream] = {}
        self._next_port = port
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ lifecycle

    def attach(self) -> None:
        """Watch the Applier from now on: before ingest starts, or blocks go undescribed."""
        self.applier.observer = self

    async def start(self) -> None:
        self.attach()
        self._task = asyncio.create_task(self._ticks(), name="kvwire-event-streams")

    async def stop(self) -> None:
        if self.applier.observer is self:
            self.applier.observer = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for s in self._streams.values():
            s.pub.close(linger=0)
            s.replay.close(linger=0)
        self._ctx.term()

    async def _ticks(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # one bad request or socket must not end every stream
                log.exception("event streams tick failed")
            await asyncio.sleep(TICK_S)

    # ------------------------------------------------------------ AppliedObserver

    def records_applied(self, values: Sequence[bytes | None]) -> None:
        # One batch per record that changed what the worker holds, as an engine sends one per
        # step: the index already holds the whole slice, so a block a later record of the slice
        # changes again goes out as its end state, once.
        for v in values:
            self.table.observe_values((v,))
            self._publish_changes()

    def batch_applied(self, batch: EventBatch) -> None:
        self.table.observe(batch)
        self._publish_changes()

    def workers_dropped(self, workers: Iterable[Worker]) -> None:
        self.table.dropped(workers)
        self._publish_changes()

    # ------------------------------------------------------------ publishing

    def _publish_changes(self) -> None:
        for worker, changes in self.table.refresh().items():
            self._publish(self._stream(worker), changes)

    def _publish(self, s: _Stream, changes: list[Change]) -> None:
        if not self.applier.ranks.worker_trusted(s.worker):
            if not s.cleared or not s.started:
                s.send([AllBlocksCleared()])
                s.cleared = s.started = True
            return
        if s.cleared or not s.started:
            # Trusted again (or first seen trusted): the client holds nothing of it; all of it.
            first = not s.started
            s.cleared, s.started = False, True
            chunks = _chunks(self._stores(s.worker, self.table.held(s.worker)))
            for events in chunks or ([[]] if first else []):
                s.send(events)
            return
        for events in _chunks(self._diff(s.worker, changes)):
            s.send(events)

    def _diff(self, worker: Worker, changes: list[Change]) -> list[Event]:
        gone: dict[Place, list[Change]] = {}
        new: dict[Place, set[int]] = {}
        for c in changes:
            if c.held:
                new.setdefault(c.place, set()).add(c.key)
            else:
                gone.setdefault(c.place, []).append(c)
        events: list[Event] = []
        for (medium, group), cs in gone.items():
            cs.sort(key=lambda c: -c.depth)
            events.append(BlockRemoved([c.key for c in cs], medium, self._group_idx(worker, group)))
        return events + self._stores(worker, new)

    def _group_idx(self, worker: Worker, group: int) -> int | None:
        spec = self.table.spec(worker, group)
        return group if group != 0 or (spec is not None and spec.named) else None

    def _stores(self, worker: Worker, held: dict[Place, set[int]]) -> list[Event]:
        """BlockStored events for these blocks: chains of one sequence in one event, every
        parent in an event before its children's."""
        blocks = self.table.blocks
        out: list[Event] = []
        for (medium, group), keys in held.items():
            known = sorted((k for k in keys if k in blocks), key=lambda k: blocks[k].depth)
            runs: list[list[int]] = []
            tail: dict[int, int] = {}  # a run's last key -> the run
            for k in known:
                b = blocks[k]
                r = tail.pop(b.parent, None) if b.parent is not None else None
                if r is not None and _same_run(blocks[runs[r][-1]], b) and len(runs[r]) < MAX_RUN_BLOCKS:
                    runs[r].append(k)
                else:
                    if r is not None:
                        tail[runs[r][-1]] = r
                    r = len(runs)
                    runs.append([k])
                tail[k] = r
            spec = self.table.spec(worker, group)
            gidx = self._group_idx(worker, group)
            for run in runs:
                first = blocks[run[0]]
                tokens: list[int] = []
                extras = []
                for k in run:
                    tokens.extend(blocks[k].token_ids.tolist())
                    extras.append(blocks[k].extra_keys)
                out.append(
                    BlockStored(
                        run,
                        first.parent,
                        tokens,
                        first.block_size,
                        first.lora_id,
                        medium,
                        first.lora_name,
                        extras if any(e is not None for e in extras) else None,
                        gidx,
                        spec.kind if spec is not None else None,
                        spec.window if spec is not None else None,
                    )
                )
        return out

    # ------------------------------------------------------------ streams and ticks

    def _stream(self, worker: Worker) -> _Stream:
        s = self._streams.get(worker)
        if s is not None:
            return s
        for _ in range(MAX_PORT_TRIES):
            p = self._next_port
            self._next_port += 2
            pub = self._ctx.socket(zmq.PUB)
            replay = self._ctx.socket(zmq.ROUTER)
            for sock in (pub, replay):
                sock.setsockopt(zmq.SNDHWM, HWM)
                sock.setsockopt(zmq.LINGER, 0)
            try:
                pub.bind(f"tcp://{self.host}:{p}")
                replay.bind(f"tcp://{self.host}:{p + 1}")
            except zmq.ZMQError as e:
                log.info("event streams: ports %d-%d unavailable (%s), trying the next two", p, p + 1, e)
                pub.close(linger=0)
                replay.close(linger=0)
                continue
            s = self._streams[worker] = _Stream(
                worker, worker_id(worker[0]), p, pub, replay, deque(maxlen=self.buffer_batches)
            )
            # Seq 0 says "nothing yet"; the worker's first state goes out as seq 1, so the seq a
            # late joiner first sees (a heartbeat's, the last sent) is above 0 and shows it a gap.
            s.send([AllBlocksCleared()])
            log.info("event stream of %s/%d on tcp://%s:%d (replay %d)", worker[0], worker[1], self.host, p, p + 1)
            return s
        raise RuntimeError(f"no two free ports for an event stream from {self.base_port} up")

    def tick(self) -> None:
        """Replays, trust changes no record announced (expiry), heartbeats."""
        now = time.monotonic()
        for s in self._streams.values():
            self._answer_replays(s)
            trusted = self.applier.ranks.worker_trusted(s.worker)
            if trusted == s.cleared:
                self._publish(s, [])
            if now - s.last_send >= self.heartbeat_s:
                s.heartbeat()

    def _answer_replays(self, s: _Stream) -> None:
        while s.replay.poll(0):
            frames = s.replay.recv_multipart(zmq.NOBLOCK)
            if len(frames) == 3 and frames[1] == b"":
                ident, start_b = frames[0], frames[2]
            elif len(frames) == 2:
                ident, start_b = frames[0], frames[1]
            else:
                log.warning("event stream %s/%d: replay request of %d frames ignored", *s.worker, len(frames))
                continue
            s.replays.append((ident, self._history(s, int.from_bytes(start_b, "big"))))
        budget = REPLAY_FRAMES_PER_TICK
        while s.replays and budget > 0:
            ident, answer = s.replays[0]
            for seq, payload in answer:
                s.replay.send_multipart((ident, b"", TOPIC, seq.to_bytes(8, "big"), payload))
                budget -= 1
                if budget == 0:
                    break
            else:
                s.replay.send_multipart((ident, b"", b"", END_SEQ, b""))
                s.replays.popleft()

    def _history(self, s: _Stream, start: int) -> Iterator[tuple[int, bytes]]:
        """What a replay from ``start`` answers (see the module docstring). The state is read
        now, when the request arrives, so that it is the state at the last seq sent; the frames
        are encoded lazily and go out ``REPLAY_FRAMES_PER_TICK`` at a time."""
        buf = list(s.buffer)
        if not buf or start > buf[-1][0]:
            return iter(())
        if start >= buf[0][0]:
            return iter([(q, p) for q, p in buf if q >= start])
        events: list[Event] = [AllBlocksCleared()]
        if not s.cleared:
            events += self._stores(s.worker, self.table.held(s.worker))
        return _compaction(s.worker[1], start, buf[-1][0], _chunks(events))

    # ------------------------------------------------------------ listing

    def listing(self) -> list[dict[str, Any]]:
        """``/v1/streams``: one entry per stream, in port order. Read on ingest's loop."""
        models: dict[Worker, str] = {}
        for r in self.applier.ranks.core.ranks():
            m = getattr(r, "model", "") or ""  # the fence's rank rows name the served model
            if m and (r.instance_id, r.dp_rank) not in models:
                models[(r.instance_id, r.dp_rank)] = m
        return [
            {
                "instance_id": s.worker[0],
                "dp_rank": s.worker[1],
                "worker_id": s.worker_id,
                "endpoint": f"tcp://{self.host}:{s.port}",
                "replay_endpoint": f"tcp://{self.host}:{s.port + 1}",
                "block_size": self.table.block_size(s.worker),
                "model": models.get(s.worker, ""),
            }
            for s in sorted(self._streams.values(), key=lambda s: s.port)
        ]

    def endpoint(self, instance_id: str, dp_rank: int) -> str | None:
        """Where a worker's stream publishes, if it has one (Dynamo's ``/workers`` names it).
        A dict read, safe from the HTTP threads."""
        s = self._streams.get((instance_id, dp_rank))
        return None if s is None else f"tcp://{self.host}:{s.port}"

    def seq(self, worker: Worker) -> int:
        """The next seq of a worker's stream (-1: no stream): for tests and operators."""
        s = self._streams.get(worker)
        return -1 if s is None else s.seq


def _compaction(dp_rank: int, start: int, last: int, chunks: list[list[Event]]) -> Iterator[tuple[int, bytes]]:
    """A state under the seqs ``start..last``, a batch each, the last of them all that is left
    when there are fewer seqs than batches; empty batches fill the rest."""
    slots = last - start + 1
    if len(chunks) > slots:
        chunks[slots - 1 :] = [[e for c in chunks[slots - 1 :] for e in c]]
    now = time.time()
    for i, c in enumerate(chunks):
        yield start + i, encode(Batch(now, c, dp_rank))
    filler = encode(Batch(now, [], dp_rank))
    for q in range(start + len(chunks), last + 1):
        yield q, filler


def _chunks(events: list[Event]) -> list[list[Event]]:
    """Events in order, cut into batches within ``MAX_BATCH_EVENTS`` and ``MAX_BATCH_TOKENS``."""
    out: list[list[Event]] = []
    cur: list[Event] = []
    tokens = 0
    for e in events:
        n = len(e.token_ids) if isinstance(e, BlockStored) else 0
        if cur and (len(cur) >= MAX_BATCH_EVENTS or tokens + n > MAX_BATCH_TOKENS):
            out.append(cur)
            cur, tokens = [], 0
        cur.append(e)
        tokens += n
    if cur:
        out.append(cur)
    return out


def _same_run(prev: Block, b: Block) -> bool:
    return prev.block_size == b.block_size and prev.lora_name == b.lora_name and prev.lora_id == b.lora_id
