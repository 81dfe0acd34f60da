"""LMCache's multi-process server, as far as its coordinator topic is concerned, on CPU.

The real pieces: LMCache's ``CacheEventSubscriber`` (bus events -> batches, seq,
incarnation, token stamping), its ``KafkaCacheEventSink`` (confluent-kafka, the real
broker), its ``ObjectKey``/``kv_rank`` packing and its ``TokenHasher`` (blake3 chunk
hashes). What is stood in for: the storage engine that would raise the bus events
(it needs the GPU transfer path), so ``MpServer`` raises them the way LMCache's store
path does (``_publish_token_bindings`` then write-finished per rank; evictions and L2
stores/deletes with their metadata contracts).

``MpServer.truth`` is the ground truth the index is checked against: the placements
LMCache's own key directory would hold for the instance.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ci_env import unavailable


def require(module: str):
    """Import an optional engine; under CI=true it is installed, so a missing one FAILS."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        unavailable(f"{module} is not installed (CI installs it): {e}")


class MpServer:
    def __init__(
        self,
        bootstrap: str,
        topic: str,
        instance_id: str,
        incarnation: int,
        world: int = 1,
        chunk: int = 4,
        model: str = "m",
        sink=None,
    ):
        from lmcache.v1.mp_coordinator.cache_events import CacheEventSubscriber, KafkaCacheEventSink
        from lmcache.v1.multiprocess.config import KafkaCacheEventSinkConfig
        from lmcache.v1.multiprocess.token_hasher import TokenHasher

        self.hasher = TokenHasher(chunk_size=chunk, hash_algorithm="blake3")
        self.chunk, self.world, self.model, self.instance_id = chunk, world, model, instance_id
        self.kafka = KafkaCacheEventSink(KafkaCacheEventSinkConfig(bootstrap, topic)) if sink is None else None
        self.sink = sink if sink is not None else self.kafka
        self.sub = CacheEventSubscriber(self.sink, instance_id, incarnation, flush_interval=3600.0)
        self.handlers = self.sub.get_subscriptions()
        # (tier, backend, kv_rank, chunk_hash, salt) placements, as LMCache's directory keeps them (a set)
        self.truth: set[tuple[str, str, int, bytes, str]] = set()

    # ------------------------------------------------------------ keys

    def kv_rank(self, rank: int) -> int:
        from lmcache.v1.distributed.api import ObjectKey

        return ObjectKey.ComputeKVRank(self.world, rank, self.world, rank)

    def hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return self.hasher.compute_chunk_hashes(list(tokens))

    def keys(self, hashes: Sequence[bytes], rank: int, salt: str = ""):
        from lmcache.v1.distributed.api import ObjectKey

        return [ObjectKey(h, self.model, self.kv_rank(rank), 0, salt) for h in hashes]

    def _raise(self, event_type, **metadata) -> None:
        from lmcache.v1.mp_observability.event import Event

        self.handlers[event_type](Event(event_type, metadata=metadata))

    # ------------------------------------------------------------ the store path

    def store(
        self,
        tokens: Sequence[int],
        start: int = 0,
        ranks: Sequence[int] | None = None,
        salt: str = "",
        l2: str | None = None,
    ) -> list[bytes]:
        """Store tokens[start:] (chunk-aligned) in L1 DRAM on ``ranks`` (default all), and in
        L2 backend ``l2`` if given. Returns the chunk hashes of the whole sequence."""
        from lmcache.v1.distributed.api import L1BackendType
        from lmcache.v1.distributed.internal_api import L1ObjectMeta
        from lmcache.v1.mp_observability.event import EventType

        hs = self.hashes(tokens)
        first = start // self.chunk
        new = hs[first:]
        offsets = [i * self.chunk for i in range(first, len(hs))]
        self._raise(
            EventType.MP_TOKENS,
            chunk_hashes=new,
            token_chunks=[list(tokens[o : o + self.chunk]) for o in offsets],
            token_offsets=offsets,
            parent_hashes=[hs[i - 1] if i else None for i in range(first, len(hs))],
        )
        for r in range(self.world) if ranks is None else ranks:
            keys = self.keys(new, r, salt)
            self._raise(
                EventType.L1_WRITE_FINISHED,
                keys=keys,
                meta=[L1ObjectMeta(self.chunk * 64, L1BackendType.DRAM) for _ in keys],
            )
            self.truth |= {("l1", "dram", r, h, salt) for h in new}
            if l2:
                self._raise(EventType.L2_KEYS_STORED, keys=keys, sizes=[self.chunk * 64] * len(keys), backend=l2)
                self.truth |= {("l2", l2, r, h, salt) for h in new}
        return hs

    def evict(
        self, hashes: Sequence[bytes], ranks: Sequence[int] | None = None, salt: str = "", l2: str | None = None
    ) -> None:
        """L1 eviction (or an L2 delete on ``l2``) of these chunks on ``ranks``."""
        from lmcache.v1.distributed.api import L1BackendType
        from lmcache.v1.distributed.internal_api import L1ObjectMeta
        from lmcache.v1.mp_observability.event import EventType

        for r in range(self.world) if ranks is None else ranks:
            keys = self.keys(hashes, r, salt)
            if l2:
                self._raise(EventType.L2_KEYS_DELETED, keys=keys, backend=l2)
                self.truth -= {("l2", l2, r, h, salt) for h in hashes}
            else:
                self._raise(
                    EventType.L1_KEYS_EVICTED,
                    keys=keys,
                    meta=[L1ObjectMeta(self.chunk * 64, L1BackendType.DRAM) for _ in keys],
                )
                self.truth -= {("l1", "dram", r, h, salt) for h in hashes}

    def access(self, hashes: Sequence[bytes]) -> None:
        from lmcache.v1.mp_observability.event import EventType

        self._raise(EventType.L1_KEYS_ACCESSED, keys=self.keys(hashes, 0))

    def flush(self, delivered: bool = False) -> None:
        """Flush the subscriber's pending batches; ``delivered``: also wait until the broker
        has them (LMCache's sink publishes asynchronously; two servers' records otherwise
        race each other into the topic)."""
        self.sub.flush()
        if delivered and self.kafka is not None:
            self.kafka._producer.flush(60)

    def close(self) -> None:
        self.sub.shutdown()  # flushes the subscriber, then the producer (waits for the broker)

    # ------------------------------------------------------------ ground truth

    def expected_tokens(self, tokens: Sequence[int], placement: tuple[str, str] | None = None, salt: str = "") -> int:
        """Leading tokens of ``tokens`` whose chunks every rank holds on one placement
        (on ``placement`` = (tier, backend) only, if given)."""
        n = 0
        for h in self.hashes(tokens):
            media = {(t, b) for (t, b, _, hh, s) in self.truth if hh == h and s == salt}
            if placement is not None:
                media &= {placement}
            if not any(all((t, b, r, h, salt) in self.truth for r in range(self.world)) for t, b in media):
                break
            n += self.chunk
        return n
