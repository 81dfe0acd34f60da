"""Registry ids -> writer schemas, fetched before decoding so that decode never does I/O.

Every consumer entry point (index member, replay, tail) calls :meth:`IdResolver.prefetch` with a
poll's values before it decodes any of them: the ids of Confluent-framed values that the cache
lacks are fetched, once each. An id the registry does not know, or one that names a schema other
than kvwire's, is remembered as refused with the reason, and decode turns that reason into the
record's dead letter. A registry that does not answer is not a verdict: prefetch raises
RegistryUnavailable and the caller retries before applying anything, so no record is
dead-lettered for a transient outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

from kvwire.schemas.codec import SCHEMA_IDS, CodecError, SchemaIds

from .client import NotFound, RegistryClient, RegistryConfig, RegistryUnavailable

log = logging.getLogger("kvwire.kafka.registry")


class IdResolver:
    def __init__(self, client: RegistryClient | None, ids: SchemaIds = SCHEMA_IDS) -> None:
        self.client = client
        self.ids = ids
        self.fetched = 0
        self.refused = 0
        self.unavailable = 0  # prefetch attempts the registry did not answer

    @classmethod
    def from_env(cls, url: str | None = None, ids: SchemaIds = SCHEMA_IDS) -> IdResolver:
        """``url`` or KVWIRE_SCHEMA_REGISTRY_URL; without either, Confluent-framed records are
        refused with a reason that says what to configure."""
        cfg = RegistryConfig.from_env(url)
        return cls(None if cfg is None else RegistryClient(cfg), ids)

    def __repr__(self) -> str:
        return f"IdResolver({self.client!r})"

    def resolve(self, schema_ids: Iterable[int]) -> None:
        """Fetch these ids into the cache (blocking). Raises RegistryUnavailable."""
        for sid in sorted(set(schema_ids)):
            if self.ids.known(sid):
                continue
            if self.client is None:
                # Nothing cached: decode's own reason ("no schema registry was asked") says what
                # to configure, and a resolver with a registry in the same process still asks.
                continue
            try:
                text = self.client.schema(sid)
            except NotFound:
                self._refuse(sid, f"schema id {sid} is not known to the schema registry at {self.client.url}")
                continue
            except RegistryUnavailable:
                raise
            except Exception as e:  # an answer that is not a schema: a verdict, not an outage
                self._refuse(sid, f"schema id {sid}: the registry's answer is unusable: {e}")
                continue
            try:
                self.ids.add(sid, text)
                self.fetched += 1
            except CodecError as e:
                self._refuse(sid, str(e))

    def _refuse(self, sid: int, reason: str) -> None:
        self.ids.refuse(sid, reason)
        self.refused += 1
        log.warning("%s", reason)

    async def prefetch(self, values: Iterable[bytes | None]) -> int:
        """Resolve the ids these values name that the cache lacks; returns how many were asked.
        Raises RegistryUnavailable (nothing cached for the ids it could not fetch)."""
        if self.client is None:
            return 0
        missing = self.ids.missing(values)
        if not missing:
            return 0
        await asyncio.to_thread(self.resolve, missing)
        return len(missing)

    async def prefetch_retrying(
        self,
        values: Iterable[bytes | None],
        stop: asyncio.Event | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        deadline_s: float | None = None,
    ) -> int:
        """prefetch() until the registry answers, ``stop`` is set or ``deadline_s`` passes (then
        RegistryUnavailable is raised): a consumer must not apply past an id it could not resolve."""
        values = list(values)
        loop = asyncio.get_running_loop()
        give_up = None if deadline_s is None else loop.time() + deadline_s
        delay = backoff_s
        warned = False
        while True:
            try:
                return await self.prefetch(values)
            except RegistryUnavailable as e:
                self.unavailable += 1
                if (stop is not None and stop.is_set()) or (give_up is not None and loop.time() >= give_up):
                    raise
                log.log(logging.DEBUG if warned else logging.WARNING, "schema registry unavailable, retrying: %s", e)
                warned = True
            if stop is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            delay = min(max_backoff_s, delay * 2)
