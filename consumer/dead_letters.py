"""The dead-letter topic: where a record the index cannot take is kept whole.

The writer owns the member's only producer. A dead letter is the only copy of its record once
the commit passes its offset, so ``flush`` returns only when every letter is on the broker,
and a letter that did not land goes back to the applier for the next flush (a retry may write
one twice, never lose one); ``Membership.commit`` flushes before it commits.
"""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaProducer

from .apply import Applier, DeadLetter

log = logging.getLogger(__name__)


class DeadLetterWriter:
    def __init__(self, bootstrap_servers: str, topic: str, client_options: dict | None = None):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.client_options = dict(client_options or {})
        self.producer: AIOKafkaProducer | None = None

    async def start(self, replication_factor: int | None = None, min_insync_replicas: int | None = None) -> None:
        self.producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap_servers, enable_idempotence=True, **self.client_options
        )
        await self.producer.start()
        await self._ensure_topic(replication_factor, min_insync_replicas)

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()

    async def _ensure_topic(self, replication_factor: int | None, min_insync_replicas: int | None) -> None:
        """Create the topic up front (replicated like the events) so the first bad record is
        not also the first metadata miss; a broker that forbids it gets a warning."""
        from kvwire.kafka.topics import Replication, ensure_topic

        try:
            await ensure_topic(
                self.bootstrap_servers,
                self.topic,
                1,
                replication=Replication.from_env(
                    replication_factor=replication_factor, min_insync_replicas=min_insync_replicas
                ),
                client_options=self.client_options,
            )
        except Exception as e:
            log.warning("cannot create dead-letter topic: %r", e)

    async def flush(self, applier: Applier) -> None:
        """Write the applier's dead letters; raises (keeping them queued) if not all landed."""
        dead = applier.take_dead_letters()
        if not dead:
            return
        try:
            await self.send(dead)
        except BaseException:
            applier.dead_letters[:0] = dead
            raise

    async def send(self, dead: list[DeadLetter]) -> None:
        assert self.producer is not None  # started with the member
        futs = []
        for d in dead:
            headers = [
                ("kvwire-error", d.error.encode()[:4096]),
                ("kvwire-source-topic", d.topic.encode()),
                ("kvwire-source-partition", str(d.partition).encode()),
                ("kvwire-source-offset", str(d.offset).encode()),
                ("kvwire-source-timestamp", str(d.timestamp_ms).encode()),
            ]
            futs.append(
                # A null-key tombstone is a legal record that our client refuses to write back:
                # an empty key (the source coordinates are in the headers anyway).
                await self.producer.send(
                    self.topic,
                    d.value,
                    key=d.key if d.key is not None or d.value is not None else b"",
                    headers=headers,
                )
            )
        await asyncio.gather(*futs)
        log.warning("dead-lettered %d record(s); last: %s", len(dead), dead[-1].error)


__all__ = ["DeadLetterWriter"]
