"""In-process scoring: a router written in Python embeds the index and asks it directly.

The same answers as ``POST /v1/score`` with no HTTP at all: ``Scorer.score_json`` is the
very call the HTTP handler makes (``Applier.score_json``: the core hashes the prompt,
walks the index, drops untrusted workers, orders and encodes), so the bytes are those
the HTTP answer's ``"scores"`` holds, and ``Scorer.score`` decodes them into
``WorkerScore`` objects. ``EmbeddedIndex`` runs a whole index member (consumer-group
member, fencing, snapshots) on its own event loop in a background thread::

    from kvwire.consumer.router import EmbeddedIndex

    with EmbeddedIndex("127.0.0.1:19092", topic="kvwire.events") as index:
        index.wait_ready(timeout_s=60)
        for s in index.score(prompt_token_ids, top_k=4):  # best first
            print(s.instance_id, s.dp_rank, s.matched_tokens, s.score)

Token ids may be a list of ints, an ``array('I')`` or a uint32 numpy array (read in place).
``cache_salt`` and ``extra_keys`` (per block, as vLLM publishes them) select a tenant's blocks
(``kvwire.consumer.tenants``). ``Scorer.route`` picks a worker and records a speculative hold
on it (``kvwire.consumer.holds``), which later scores show as ``speculative_tokens``.
Like ``kvwire index``, the member joins its own consumer group by default (a full index
per router): ``kvwire-index.<topic>.<hostname>``, so two embedding routers on one host must
pass distinct ``group`` names; pass a shared ``group`` to split partitions with other members.

How a reader stays consistent while ingest applies: every record is applied whole inside
one quantum of a core call (``_core.apply_poll``, see ``rust/src/pipeline.rs``), and a score
sees the index either before or after such a quantum, never inside one. Applying and scoring
both run in the core with the GIL released, so scores from several threads (this router's, or
``kvwire index --http-workers N``'s loops) walk the index at the same time while ingest runs
its Python; they hold the index's read side, and a quantum waits for the scores in flight and
holds its write side until it ends, early when a reader waits (``rust/src/py_index.rs``,
``Shared``). No reader sees half a record: a score equals the one the oracle gives for some
prefix of the applied records (``tests/consumer/test_router.py``).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from .apply import Applier
from .holds import HeldScore, Holds, Route, route, score_json_with_holds
from .index import WorkerScore
from .tenants import check_cache_salt, check_extra_keys, tenant_extra_keys

DEFAULT_TOP_K = 64  # /v1/score's default ``limit``
_scores = msgspec.json.Decoder(list[HeldScore])
T = TypeVar("T")
_ARRAY_I = sys.byteorder == "little" and array("I").itemsize == 4


class Scorer:
    """Scores from an ``Applier`` in this process (the HTTP handler's own call).

    ``holds``: the router's speculative holds (``Scorer.route`` records them); None: its own,
    with the default TTL."""

    def __init__(self, applier: Applier, holds: Holds | None = None) -> None:
        self.applier = applier
        self.holds = holds if holds is not None else Holds()

    def score_json(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int = DEFAULT_TOP_K,
        cache_salt: str | None = None,
        extra_keys: Any = None,
    ) -> bytes:
        """The JSON list ``/v1/score`` answers under ``"scores"``, byte for byte."""
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        token_ids, extra = self._query(token_ids, lora_name, block_size, cache_salt, extra_keys)
        return score_json_with_holds(self.applier, self.holds, token_ids, lora_name, block_size, top_k, extra)

    def score(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        block_size: int | None = None,
        top_k: int = DEFAULT_TOP_K,
        cache_salt: str | None = None,
        extra_keys: Any = None,
    ) -> list[WorkerScore]:
        """Trusted workers holding a prefix of ``token_ids``, best first, at most ``top_k``
        (``HeldScore``s: ``speculative_tokens`` is a live hold's credit, 0 without one)."""
        return list(_scores.decode(self.score_json(token_ids, lora_name, block_size, top_k, cache_salt, extra_keys)))

    def route(
        self,
        token_ids: Any,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        extra_keys: Any = None,
        candidates: list[tuple[str, int]] | None = None,
        block_size: int | None = None,
    ) -> Route:
        """What ``POST /v1/route`` does: the best worker for the prompt (``holds`` module doc for
        the tie-break), with a hold recorded on it. Raises ``holds.NoCandidate`` when there is
        no candidate and no trusted worker."""
        token_ids, extra = self._query(token_ids, lora_name, block_size, cache_salt, extra_keys)
        return route(self.applier, self.holds, token_ids, lora_name, extra, candidates, block_size)

    @staticmethod
    def _query(
        token_ids: Any, lora_name: str | None, block_size: int | None, cache_salt: str | None, extra_keys: Any
    ) -> tuple[Any, list[Any] | None]:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        check_cache_salt(cache_salt)
        check_extra_keys(extra_keys)
        if isinstance(token_ids, list | tuple) and _ARRAY_I:
            token_ids = array("I", token_ids)  # read in place by the core; OverflowError outside uint32
        return token_ids, tenant_extra_keys(extra_keys, cache_salt, lora_name)


class EmbeddedIndex(Scorer):
    """An index member (``kvwire index`` without the HTTP API) inside the router's process."""

    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "kvwire.events",
        group: str | None = None,
        heartbeat_timeout_s: float = 60.0,
        snapshots: bool = True,
        snapshot_dir: str | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        from .ingest import IndexMember, IngestConfig, default_group_id

        opts = client_options or {}
        cfg = IngestConfig(
            bootstrap_servers,
            topic,
            group_id=group or default_group_id(topic, None),
            heartbeat_timeout_s=heartbeat_timeout_s,
            client_options=opts,
        )
        store = None
        if snapshots:
            from .snapshot import snapshot_store

            store = snapshot_store(bootstrap_servers, topic, directory=snapshot_dir, client_options=opts)
        self.member = IndexMember(cfg, snapshots=store)
        super().__init__(self.member.applier)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvwire-embedded-index", daemon=True)

    def start(self) -> EmbeddedIndex:
        self._thread.start()
        self._call(self.member.start())
        return self

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        try:
            self._call(self.member.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    def __enter__(self) -> EmbeddedIndex:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the member's loop: Python-side state (the rank table's dicts) is
        only consistent there, between ingest steps."""

        async def call() -> T:
            return fn()

        result: T = self._call(call())
        return result

    @property
    def ready(self) -> bool:
        """Caught up with the end offsets seen at assignment (``/healthz``'s ``ready``)."""
        return self._on_loop(lambda: bool(self.member.ready))

    @property
    def failure(self) -> str | None:
        """Why the member is unhealthy (ingest died, snapshots failing); None while healthy."""
        return self.member.failure

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self.failure is not None:
                raise RuntimeError(f"index member unhealthy: {self.failure}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"index member not caught up after {timeout_s}s")
            time.sleep(0.05)

    def workers(self) -> list[dict[str, Any]]:
        """What ``GET /v1/workers`` answers: per worker blocks, epochs, seqs, trust."""
        return self._on_loop(self.applier.workers)


__all__ = ["DEFAULT_TOP_K", "EmbeddedIndex", "Scorer"]
