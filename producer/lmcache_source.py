"""LMCache as an event source: drain ``LMCacheEngine.get_kv_events()`` into a rank stream.

LMCache 0.5.6 emits only stores (``CacheStoreEvent``, one chunk each) and three
known defects, each repaired here (and by the KV connector wrapper, which sees
the same events through ``LMCacheConnectorV1``):

1. ``token_ids`` holds ``block_size + 1`` tokens for every non-final chunk
   (LMCache #4543: a ``[start:end+1]`` slice). Trimmed to ``block_size`` per
   hash: the extra token belongs to the next chunk, and the index chains its
   own keys over exactly the block's tokens.
2. A store with a mask (incremental: the prefix was stored earlier) reports
   ``parent_block_hash=0`` for its first chunk: LMCache's loop starts its
   ``prev_key`` at 0. Repaired by *verification*, never by guessing: each chunk
   hash this source has recently seen is tried as the prefix, with LMCache's
   own chunk hash function, and the one that reproduces the event's hash is
   the parent. If none does (prefix stored before this source started, or
   evicted from the candidate window, or request-specific extra keys), the
   parent stays 0 and is counted: 0 is a hash no real chunk has, so consumers
   see an unknown parent and do not chain the block, whereas ``None`` would
   claim the chunk starts a sequence and make the index invent a wrong prefix.
3. ``medium`` is ``"cpu"`` or a ``torch.device``: normalised like any medium
   (``kvwire.producer.vllm_wire.normalize_medium``, so "cpu" -> "CPU").

No torch import here: the engine object is handed in by the caller.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from kvwire.schemas.events import BlockStored, KVEvent

from .sink import EventSink
from .vllm_wire import WireError, event_from_object

log = logging.getLogger(__name__)

# hash(prefix_hash, chunk_tokens) -> chunk hash, as the engine computes it.
ChunkHasher = Callable[[list, Any], Any]

# LMCache's sentinel for "no previous chunk in this store call".
UNKNOWN_PARENT = 0


@dataclass
class RepairStats:
    events: int = 0
    tokens_trimmed: int = 0
    parents_repaired: int = 0
    parents_unrepaired: int = 0
    bad_events: int = 0


def engine_chunk_hasher(engine: Any) -> ChunkHasher | None:
    """The engine's own chunk hash, or None if this LMCache has no usable one."""
    db = getattr(engine, "token_database", None)
    fn = getattr(db, "_hash_tokens", None)
    if fn is None:
        return None
    return lambda tokens, prefix: fn(list(tokens), prefix)


class LMCacheRepair:
    """Turns LMCache store events into well-formed kvwire ``BlockStored``s.

    Keeps a bounded window of recently seen chunk hashes (newest last) as parent
    candidates; the window is per source, i.e. per LMCache engine (one rank).
    """

    def __init__(self, hasher: ChunkHasher | None = None, window: int = 4096, max_tries: int = 256):
        self.hasher = hasher
        self.window = window
        # Verifying costs one chunk hash per candidate; the true parent is almost
        # always among the newest (the same request's previous store).
        self.max_tries = max_tries
        self._recent: OrderedDict[Any, None] = OrderedDict()
        self.stats = RepairStats()

    def _remember(self, h: Any) -> None:
        self._recent[h] = None
        self._recent.move_to_end(h)
        if len(self._recent) > self.window:
            self._recent.popitem(last=False)

    def _find_parent(self, tokens: list, chunk_hash: Any) -> Any:
        if self.hasher is None:
            return None
        for i, cand in enumerate(reversed(self._recent)):
            if i >= self.max_tries:
                break
            try:
                if self.hasher(tokens, cand) == chunk_hash:
                    return cand
            except Exception:
                return None
        return None

    def repair(self, ev: BlockStored) -> BlockStored:
        self.stats.events += 1
        changes: dict[str, Any] = {}
        n = len(ev.block_hashes)
        want = ev.block_size * n
        if n and ev.block_size and len(ev.token_ids) > want:
            changes["token_ids"] = ev.token_ids[:want]
            self.stats.tokens_trimmed += 1
        if ev.parent_block_hash == UNKNOWN_PARENT and n:
            tokens = list(changes.get("token_ids", ev.token_ids)[: ev.block_size])
            parent = self._find_parent(tokens, ev.block_hashes[0])
            if parent is not None:
                changes["parent_block_hash"] = parent
                self.stats.parents_repaired += 1
            else:
                self.stats.parents_unrepaired += 1
        for h in ev.block_hashes:
            self._remember(h)
        return replace(ev, **changes) if changes else ev

    def convert(self, raw: Iterable[Any]) -> list[KVEvent]:
        """LMCache/vLLM event objects -> repaired kvwire events; bad ones counted and skipped."""
        out: list[KVEvent] = []
        for r in raw:
            try:
                ev = event_from_object(r)
            except WireError as e:
                self.stats.bad_events += 1
                log.warning("skipping LMCache event: %s", e.reason)
                continue
            out.append(self.repair(ev) if isinstance(ev, BlockStored) else ev)
        return out


class LMCacheSource:
    """Polls one LMCacheEngine and publishes what it stored.

    ``poll_once()`` can be called from the thread that runs the engine (no race);
    ``start()`` polls from a daemon thread every ``interval_s``. LMCache's
    drain swaps its list without a lock, so a store appended concurrently with
    the swap can be lost to every consumer of ``get_kv_events``, LMCache's own
    vLLM connector included; prefer ``poll_once`` on the engine's thread where
    the caller owns one.
    """

    def __init__(self, engine: Any, sink: EventSink, interval_s: float = 0.05, repair: LMCacheRepair | None = None):
        self.engine = engine
        self.sink = sink
        self.interval_s = interval_s
        self.repair = repair or LMCacheRepair(engine_chunk_hasher(engine))
        self.polls = 0
        self.published = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> int:
        """Drain and publish; returns the number of events published. Never raises."""
        try:
            self.polls += 1
            raw = self.engine.get_kv_events()
            if not raw:
                return 0
            events = self.repair.convert(raw)
            if events and self.sink.publish(events):
                self.published += len(events)
            return len(events)
        except Exception as e:
            self.errors += 1
            log.warning("LMCache poll failed: %s: %s", type(e).__name__, e)
            return 0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll_once()
        self.poll_once()  # what was stored before stop() still goes out

    def start(self) -> LMCacheSource:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvwire-lmcache-source", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


__all__ = ["UNKNOWN_PARENT", "LMCacheRepair", "LMCacheSource", "RepairStats", "engine_chunk_hasher"]
