"""A fleet of paged prefix caches that emits the KV events a vLLM fleet would.

Used by tests (feed an in-memory oracle), benchmarks and the demo (feed
``RankStream.publish``). Deterministic for a seed. What it models, because the
index must survive exactly these: shared system prompts (many workers hold the
same blocks), multi-turn sessions (each turn extends the previous prompt),
LRU eviction under a fixed capacity (BlockRemoved before the BlockStored that
reuses the space, as vLLM does), occasional ``reset_prefix_cache``
(AllBlocksCleared) and engine restarts (silent loss of everything: a new epoch).
"""

from __future__ import annotations

import hashlib
import random
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, WorkerId

Sink = Callable[[WorkerId, list[KVEvent]], None]


@dataclass
class SimConfig:
    workers: int = 4
    dp_size: int = 1  # workers per instance: worker i is (sim-{i // dp_size}, i % dp_size)
    tp_size: int = 1
    capacity_blocks: int = 1024
    block_size: int = 16
    system_prompts: int = 6
    system_prompt_blocks: tuple[int, int] = (4, 48)
    max_sessions: int = 64
    # Blocks a turn adds (user message + previous answer); a partial tail block is never cached.
    turn_blocks: tuple[int, int] = (1, 12)
    max_session_blocks: int = 256
    p_new_session: float = 0.15
    # Most turns go back to the worker that served the session (what a KV-aware router does).
    p_sticky: float = 0.8
    p_clear: float = 0.001
    p_restart: float = 0.0005
    vocab: int = 32000
    seed: int = 0
    hash_algo: str = "sha256"  # or "xxhash" (vLLM's --prefix-caching-hash-algo)
    model: str = "sim-model"
    medium: str = "GPU"


@dataclass(frozen=True)
class Request:
    token_ids: array
    # The worker whose cache holds the longest prefix of the prompt (None: nobody holds any).
    expected_worker: int | None
    expected_blocks: int
    session: int


class _Session:
    __slots__ = ("tokens", "worker")

    def __init__(self, tokens: array, worker: int | None) -> None:
        self.tokens = tokens
        self.worker = worker


class Simulator:
    def __init__(
        self,
        config: SimConfig | None = None,
        sink: Sink | None = None,
        on_restart: Callable[[WorkerId], None] | None = None,
    ) -> None:
        self.cfg = c = config or SimConfig()
        self.sink = sink
        self.on_restart = on_restart
        self.rng = random.Random(c.seed)
        # vLLM seeds its chain with NONE_HASH; one value for the fleet (PYTHONHASHSEED set).
        self._none_hash = self.rng.randbytes(32)
        self._hash = self._make_hasher(c.hash_algo)
        self.workers: list[tuple[str, int]] = [(f"sim-{i // c.dp_size}", i % c.dp_size) for i in range(c.workers)]
        self.ranks: list[list[WorkerId]] = [
            [WorkerId(inst, dp, tp, c.tp_size, c.model) for tp in range(c.tp_size)] for inst, dp in self.workers
        ]
        # Per worker: engine hash -> chain digest, in LRU order (oldest first).
        self.caches: list[OrderedDict[int, bytes]] = [OrderedDict() for _ in self.workers]
        self.system_prompts = [
            self._tokens(self.rng.randint(*c.system_prompt_blocks) * c.block_size) for _ in range(c.system_prompts)
        ]
        self.sessions: list[_Session] = []
        self.steps = 0
        self.restarts = 0
        self.clears = 0

    # ------------------------------------------------------------------ hashing

    def _make_hasher(self, algo: str) -> Callable[[bytes, bytes], tuple[bytes, int]]:
        if algo == "sha256":

            def h(parent: bytes, tokens: bytes) -> tuple[bytes, int]:
                d = hashlib.sha256(parent + tokens).digest()
                return d, int.from_bytes(d[-8:], "big")  # low 64 bits, unsigned: often >= 2^63
        elif algo == "xxhash":
            import xxhash

            def h(parent: bytes, tokens: bytes) -> tuple[bytes, int]:
                d = xxhash.xxh3_128_digest(parent + tokens)
                return d, int.from_bytes(d[-8:], "big")
        else:
            raise ValueError(f"unknown hash_algo {algo!r}")
        return h

    def block_chain(self, tokens: array) -> list[tuple[int, bytes]]:
        """(engine hash, chain digest) of every full block of ``tokens``."""
        bs = self.cfg.block_size
        parent = self._none_hash
        out = []
        for i in range(len(tokens) // bs):
            parent, eh = self._hash(parent, tokens[i * bs : (i + 1) * bs].tobytes())
            out.append((eh, parent))
        return out

    def _tokens(self, n: int) -> array:
        r, v = self.rng.randrange, self.cfg.vocab
        return array("I", [r(v) for _ in range(n)])

    # ------------------------------------------------------------------ requests

    def prefix_blocks(self, worker: int, tokens: array, chain=None) -> int:
        """How many leading blocks of ``tokens`` the worker holds."""
        cache = self.caches[worker]
        n = 0
        for eh, _ in chain if chain is not None else self.block_chain(tokens):
            if eh not in cache:
                break
            n += 1
        return n

    def best_worker(self, tokens: array) -> tuple[int | None, int]:
        chain = self.block_chain(tokens)
        best, best_n = None, 0
        for w in range(len(self.workers)):
            n = self.prefix_blocks(w, tokens, chain)
            if n > best_n:
                best, best_n = w, n
        return best, best_n

    def next_request(self) -> Request:
        """The next prompt (a new session on a shared system prompt, or the next turn of one)
        and the worker the simulator expects to hold most of it. Changes no cache."""
        c, rng = self.cfg, self.rng
        if not self.sessions or (len(self.sessions) < c.max_sessions and rng.random() < c.p_new_session):
            sp = self.system_prompts[rng.randrange(len(self.system_prompts))]
            tokens = sp + self._tokens(rng.randint(*c.turn_blocks) * c.block_size + rng.randrange(c.block_size))
            self.sessions.append(_Session(tokens, None))
            idx = len(self.sessions) - 1
        else:
            idx = rng.randrange(len(self.sessions))
            s = self.sessions[idx]
            if len(s.tokens) // c.block_size >= c.max_session_blocks:  # conversation over
                sp = self.system_prompts[rng.randrange(len(self.system_prompts))]
                s.tokens, s.worker = sp + self._tokens(c.block_size), None
            s.tokens = s.tokens + self._tokens(rng.randint(*c.turn_blocks) * c.block_size)
            tokens = s.tokens
        best, n = self.best_worker(tokens)
        return Request(tokens, best, n, idx)

    def serve(self, worker: int, tokens: array) -> list[KVEvent]:
        """Run a prefill of ``tokens`` on ``worker``: hit, evict, store; emits the events."""
        cache, cap = self.caches[worker], self.cfg.capacity_blocks
        chain = self.block_chain(tokens)[:cap]  # a prompt longer than the cache keeps its head
        hit = 0
        for eh, _ in chain:
            if eh not in cache:
                break
            cache.move_to_end(eh)
            hit += 1
        new = chain[hit:]
        events: list[KVEvent] = []
        overflow = len(cache) + len(new) - cap
        if overflow > 0:
            evicted = [cache.popitem(last=False)[0] for _ in range(overflow)]
            events.append(BlockRemoved(tuple(evicted), medium=self.cfg.medium))
        if new:
            for eh, d in new:
                cache[eh] = d
            bs = self.cfg.block_size
            events.append(
                BlockStored(
                    tuple(eh for eh, _ in new),
                    chain[hit - 1][0] if hit else None,
                    tokens[hit * bs : len(chain) * bs],
                    bs,
                    medium=self.cfg.medium,
                )
            )
        self._emit(worker, events)
        return events

    # ------------------------------------------------------------------ faults

    def clear(self, worker: int) -> None:
        """reset_prefix_cache: vLLM tells the world."""
        self.caches[worker].clear()
        self.clears += 1
        self._emit(worker, [AllBlocksCleared()])

    def restart(self, worker: int) -> None:
        """The engine died and came back: its cache is gone and nothing was said about it."""
        self.caches[worker].clear()
        self.restarts += 1
        for s in self.sessions:
            if s.worker == worker:
                s.worker = None
        if self.on_restart is not None:
            for rank in self.ranks[worker]:
                self.on_restart(rank)

    # ------------------------------------------------------------------ driving

    def step(self) -> Request:
        c, rng = self.cfg, self.rng
        self.steps += 1
        w = rng.randrange(len(self.workers))
        if rng.random() < c.p_restart:
            self.restart(w)
        elif rng.random() < c.p_clear:
            self.clear(w)
        req = self.next_request()
        s = self.sessions[req.session]
        if s.worker is not None and rng.random() < c.p_sticky:
            target = s.worker
        elif req.expected_worker is not None and rng.random() < c.p_sticky:
            target = req.expected_worker
        else:
            target = rng.randrange(len(self.workers))
        s.worker = target
        self.serve(target, req.token_ids)
        return req

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.step()

    def _emit(self, worker: int, events: list[KVEvent]) -> None:
        if events and self.sink is not None:
            # TP ranks hold identical caches, so every rank reports the same events.
            for rank in self.ranks[worker]:
                self.sink(rank, events)
