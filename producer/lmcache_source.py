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
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from kvwire.schemas.events import BlockRemoved, BlockStored, KVEvent

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


class RemovalObserver:
    """Sees LMCache's own inserts and removals on its local CPU tier, in their true order.

    LMCache 0.5.6 emits a store event per chunk that ``store()`` processes, before the chunk is
    put, and none for removals. Two facts make those events alone wrong for an index: a chunk
    already held still gets a store event (``submit_put_task`` skips it), and an eviction can
    land between a chunk's event and its put (the same ``store()`` call allocating a later
    chunk). So membership is read where it changes: ``LocalCPUBackend``'s cache policy hears
    every insert (``update_on_put``) and every forced removal or layerwise eviction
    (``update_on_force_evict``), and ``remove(force=False)`` is the plain eviction path. All
    of them run under the backend's ``cpu_lock``, so the order they are recorded in is the
    order they happened. The hooks only append to a deque: they never block the engine and
    never raise into it. Store events supply what a put lacks (token ids, parent).

    Other tiers (disk, remote) emit nothing LMCache-side: their contents are not reported.
    """

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.transitions: deque[tuple[bool, Any]] = deque()  # (inserted?, chunk hash)
        self.hooked: list[str] = []
        self.unobserved: list[str] = []
        self.hook_errors = 0
        # Chunks the tier held before the hooks: inserted unseen, so never published.
        self.held_at_start = 0
        self._undo: list[tuple[Any, str, Any]] = []
        backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
        for name, backend in dict(backends).items():
            policy = getattr(backend, "cache_policy", None)
            if type(backend).__name__ == "LocalCPUBackend" and all(
                callable(getattr(policy, m, None)) for m in ("update_on_put", "update_on_force_evict")
            ):
                self._hook(backend, policy)
                self.hooked.append(str(name))
                self.held_at_start += len(getattr(backend, "hot_cache", None) or ())
            else:
                self.unobserved.append(str(name))

    @property
    def exact(self) -> bool:
        """Every tier that holds chunks is observed."""
        return bool(self.hooked) and not self.unobserved

    def _note(self, inserted: bool, key: Any) -> None:
        try:
            self.transitions.append((inserted, key.chunk_hash))
        except Exception:
            self.hook_errors += 1

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        orig = getattr(obj, name)
        setattr(obj, name, make(orig))
        self._undo.append((obj, name, orig))

    def _hook(self, backend: Any, policy: Any) -> None:
        note = self._note

        def on_put(orig: Callable[..., Any]) -> Callable[..., Any]:
            def update_on_put(key: Any, *a: Any, **kw: Any) -> Any:
                out = orig(key, *a, **kw)  # the engine's own step first; its errors are its own
                note(True, key)
                return out

            return update_on_put

        def on_force_evict(orig: Callable[..., Any]) -> Callable[..., Any]:
            def update_on_force_evict(key: Any, *a: Any, **kw: Any) -> Any:
                out = orig(key, *a, **kw)
                note(False, key)
                return out

            return update_on_force_evict

        def on_remove(orig: Callable[..., Any]) -> Callable[..., Any]:
            def remove(key: Any, force: bool = True) -> Any:
                out = orig(key, force=force)
                if out and not force:  # a forced remove told the policy already
                    note(False, key)
                return out

            return remove

        self._wrap(policy, "update_on_put", on_put)
        self._wrap(policy, "update_on_force_evict", on_force_evict)
        self._wrap(backend, "remove", on_remove)

    def detach(self) -> None:
        for obj, name, _orig in reversed(self._undo):
            try:
                delattr(obj, name)  # the instance attribute shadowed the class's method
            except AttributeError:
                pass
        self._undo.clear()


# A put whose store event has not arrived after this many polls never will (LMCache's drain
# race lost it, or events are off): it is reported as a gap.
MAX_PUT_WAIT_POLLS = 200
# Store events kept for puts still to come: enough for any store() call's chunks.
MAX_PENDING_STORES = 65536


class Membership:
    """LMCache store events + the observer's transitions -> the events that change what the index
    holds, in the order LMCache changed it (see :class:`RemovalObserver`)."""

    def __init__(self, observer: RemovalObserver) -> None:
        self.observer = observer
        self.removals = 0
        self.duplicates = 0  # store events for chunks LMCache already held (not inserted)
        self._stores: OrderedDict[Any, BlockStored] = OrderedDict()
        self._held: set[Any] = set()
        self._waited = 0

    def apply(self, converted: Sequence[KVEvent]) -> tuple[list[KVEvent], int]:
        """(events to publish, chunks lost: inserted but their store event never came)."""
        for c in converted:
            if isinstance(c, BlockStored):
                for h in c.block_hashes:
                    self._stores[h] = c
                    self._stores.move_to_end(h)
                while len(self._stores) > MAX_PENDING_STORES:
                    self._stores.popitem(last=False)
        out: list[KVEvent] = []
        lost = 0
        q = self.observer.transitions
        while q:
            inserted, h = q[0]
            if inserted:
                ev = self._stores.pop(h) if h in self._stores else None
                if ev is None:
                    self._waited += 1
                    if self._waited <= MAX_PUT_WAIT_POLLS:
                        break  # its store event is still in LMCache's list: next call
                    lost += 1
                    q.popleft()
                    self._waited = 0
                    continue
                self._waited = 0
                if h not in self._held:
                    self._held.add(h)
                    out.append(ev if len(ev.block_hashes) == 1 else _one_chunk(ev, h))
            elif h in self._held:
                self._held.discard(h)
                self.removals += 1
                out.append(BlockRemoved((h,), medium=CPU_MEDIUM))
            q.popleft()
        stored_in = sum(1 for ev in converted if isinstance(ev, BlockStored))
        self.duplicates += max(0, stored_in - sum(1 for ev in out if isinstance(ev, BlockStored)))
        return out, lost


class LMCacheSource:
    """Polls one LMCacheEngine and publishes what it stored and what it removed.

    ``poll_once()`` can be called from the thread that runs the engine (no race);
    ``start()`` polls from a daemon thread every ``interval_s``. LMCache's
    drain swaps its list without a lock, so a store appended concurrently with
    the swap can be lost to every consumer of ``get_kv_events``, LMCache's own
    vLLM connector included; prefer ``poll_once`` on the engine's thread where
    the caller owns one.

    With ``observe_removals`` (default) the engine's CPU tier is observed
    (:class:`RemovalObserver`) and the stream is exact: stores are published when the
    chunk is really inserted, removals when it is really removed. Without it, or when
    the engine has no observable tier, only LMCache's store events go out and the
    worker is :attr:`approximate` (it may be credited with chunks LMCache evicted).
    Every event that cannot be converted or published is reported as a gap.
    """

    def __init__(
        self,
        engine: Any,
        sink: EventSink,
        interval_s: float = 0.05,
        repair: LMCacheRepair | None = None,
        observe_removals: bool = True,
    ):
        self.engine = engine
        self.sink = sink
        self.interval_s = interval_s
        self.repair = repair or LMCacheRepair(engine_chunk_hasher(engine))
        self.observer = RemovalObserver(engine) if observe_removals else None
        self.membership = Membership(self.observer) if self.observer is not None and self.observer.hooked else None
        self.polls = 0
        self.published = 0
        self.errors = 0
        self.gaps = 0
        self._gaps_sent = 0
        held = self.observer.held_at_start if self.observer is not None else 0
        if self.membership is not None and held:
            # Their store events went by before this source: the index cannot hold them, so the
            # worker's state is not fully known (the first poll publishes the gap).
            self._gap(1, f"the engine held {held} chunk(s) before this source started")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def approximate(self) -> bool:
        """True when LMCache's removals cannot be seen: the index may overstate this worker."""
        return self.membership is None or not self.membership.observer.exact

    @property
    def removals(self) -> int:
        return self.membership.removals if self.membership is not None else 0

    @property
    def duplicates(self) -> int:
        return self.membership.duplicates if self.membership is not None else 0

    def _gap(self, n: int, why: str) -> None:
        self.gaps += n
        log.warning("LMCache source lost %d batch(es): %s", n, why)
        try:
            self.sink.report_gap(n)
        except Exception:
            log.exception("report_gap failed")

    def poll_once(self) -> int:
        """Drain and publish; returns the number of events published. Never raises."""
        events: list[KVEvent] = []
        try:
            self.polls += 1
            raw = self.engine.get_kv_events()
            bad = self.repair.stats.bad_events
            converted = self.repair.convert(raw) if raw else []
            if self.repair.stats.bad_events > bad:
                self._gap(1, f"{self.repair.stats.bad_events - bad} LMCache event(s) could not be converted")
            if self.membership is None:
                events = converted
            else:
                events, lost = self.membership.apply(converted)
                if lost:
                    self._gap(lost, f"{lost} inserted chunk(s) whose store event never came")
        except Exception as e:
            self.errors += 1
            events = []
            self._gap(1, f"poll failed: {type(e).__name__}: {e}")
        try:
            if events:
                if self.sink.publish(events):  # also carries any gap reported above
                    self.published += len(events)
                self._gaps_sent = self.gaps
            elif self.gaps > self._gaps_sent:
                self._gaps_sent = self.gaps
                self.sink.publish(())  # the gap reaches the index now, not with the next store
        except Exception as e:
            self.errors += 1
            self._gap(1, f"publish failed: {type(e).__name__}: {e}")
            try:
                self.sink.publish(())
                self._gaps_sent = self.gaps
            except Exception:
                pass
        return len(events)

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
        if self.observer is not None:
            self.observer.detach()


CPU_MEDIUM = "CPU"


def _one_chunk(ev: BlockStored, h: Any) -> BlockStored:
    """The part of a multi-chunk store event that is chunk ``h`` (LMCache sends one per event)."""
    i = ev.block_hashes.index(h)
    bs = ev.block_size
    parent = ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1]
    return replace(ev, block_hashes=(h,), parent_block_hash=parent, token_ids=ev.token_ids[i * bs : (i + 1) * bs])


__all__ = [
    "UNKNOWN_PARENT",
    "LMCacheRepair",
    "LMCacheSource",
    "Membership",
    "RemovalObserver",
    "RepairStats",
    "engine_chunk_hasher",
]
