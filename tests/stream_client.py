"""A subscriber to kvwire's event streams that does what the routers do, decoded by vLLM's own code.

It subscribes to a stream's PUB socket, and when a live batch shows a gap in seq (the first
batch it sees, too, unless its seq is 0) it asks the ROUTER socket for the missing history and
then goes on with that live batch, as vllm-router and Dynamo do (a replay's answer must start at
the seq asked for). Batches are decoded with vLLM's ``KVEventBatch`` decoder (vllm 0.33,
``vllm.distributed.kv_events``), so a layout kvwire got wrong fails here. The state it keeps
is a router's: per (medium, group) the set of block hashes stored and not removed since the
last clear. It also checks the stream's promises as it goes: seqs contiguous after a replay, a
store's parent already held (parents before children), no removal of a block whose child is
still held (children before parents), on a replay's first frame and on live batches after the
first one past a replay. It keeps what each replay stored (``replay_stored``): a replay answered
with the worker's current state stores nothing the stream does not hold at the replay's end."""

from __future__ import annotations

import zmq
from ci_env import require
from msgspec import msgpack

# vLLM's own classes (a test using this client skips locally without vllm, fails under CI=true).
_kv = require("vllm.distributed.kv_events")
AllBlocksCleared, BlockRemoved, BlockStored = _kv.AllBlocksCleared, _kv.BlockRemoved, _kv.BlockStored
_decode = msgpack.Decoder(type=_kv.KVEventBatch).decode
END = -1


class StreamClient:
    def __init__(self, endpoint: str, replay_endpoint: str, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(endpoint)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.setsockopt(zmq.RCVHWM, 0)
        self.replay.connect(replay_endpoint)
        self.next_seq: int | None = None
        self.held: dict[tuple[str | None, int | None], set[int]] = {}
        self.parents: dict[int, int | None] = {}
        self.tokens: dict[int, list[int]] = {}
        self.batches = 0
        self.replays = 0
        self.clears = 0
        self.violations: list[str] = []
        # Per replay: every block hash it stored, in any (medium, group).
        self.replay_stored: list[set[int]] = []
        self._storing: set[int] | None = None

    def close(self) -> None:
        self.sub.close(linger=0)
        self.replay.close(linger=0)

    def poll(self, timeout_ms: int = 100) -> int:
        """Take every live batch waiting (waiting up to ``timeout_ms`` for the first); returns how many."""
        n = 0
        while self.sub.poll(timeout_ms if n == 0 else 0):
            topic, seq_b, payload = self.sub.recv_multipart()
            if topic != b"":
                self.violations.append(f"topic {topic!r}")
            seq = int.from_bytes(seq_b, "big")
            n += 1
            if self.next_seq is None and seq == 0:
                self.next_seq = 0
            if self.next_seq is None or seq > self.next_seq:
                self._replay(self.next_seq or 0)
                if seq < (self.next_seq or 0):
                    continue  # the replay answered with history up to and past it
                self._apply(seq, payload, replayed=True, check=False)
                continue
            if seq < self.next_seq:
                continue
            self._apply(seq, payload)
        return n

    def _replay(self, start: int) -> None:
        self.replays += 1
        first = True
        self._storing = set()
        self.replay_stored.append(self._storing)
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            if not self.replay.poll(30_000):
                raise TimeoutError("no replay answer in 30 s")
            _, topic, seq_b, payload = self.replay.recv_multipart()
            seq = int.from_bytes(seq_b, "big", signed=True)
            if seq == END:
                self._storing = None
                return
            if topic != b"":
                self.violations.append(f"replay topic {topic!r}")
            if first and seq != start:
                self.violations.append(f"replay from {start} answered from seq {seq}")
            self._apply(seq, payload, replayed=True, check=first)
            first = False

    def _apply(self, seq: int, payload: bytes, replayed: bool = False, check: bool = True) -> None:
        if self.next_seq is not None and seq != self.next_seq and not replayed:
            self.violations.append(f"seq {seq} after {self.next_seq - 1}")
        self.next_seq = seq + 1
        self.batches += 1
        batch = _decode(payload)
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                self.clears += 1
                self.held.clear()
            elif isinstance(ev, BlockStored):
                place = (ev.medium, ev.group_idx)
                held = self.held.setdefault(place, set())
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    assert isinstance(h, int)
                    if check and parent is not None and parent not in held:
                        self.violations.append(f"store of {h} before its parent {parent}")
                    held.add(h)
                    if self._storing is not None:
                        self._storing.add(h)
                    self.parents[h] = parent  # type: ignore[assignment]
                    self.tokens[h] = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
                    parent = h
            elif isinstance(ev, BlockRemoved):
                held = self.held.setdefault((ev.medium, ev.group_idx), set())
                for h in ev.block_hashes:
                    held.discard(h)  # type: ignore[arg-type]
                gone = set(ev.block_hashes) if check else set()
                for h in held:
                    if self.parents.get(h) in gone:
                        self.violations.append(f"removal of {self.parents.get(h)} while its child {h} is held")

    def state(self) -> dict[str, set[int]]:
        """medium -> blocks held, over groups (the oracle's ``holders`` shape)."""
        out: dict[str, set[int]] = {}
        for (medium, _g), keys in self.held.items():
            if keys:
                out.setdefault(medium or "GPU", set()).update(keys)
        return out
