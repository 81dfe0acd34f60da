"""The sender's connection: an idempotent producer on a topic that exists, and the record headers.

Kept apart from the sender's loop because it is the one place where Kafka's and the registry's
settings meet the producer; the loop only needs what comes out of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvwire.schemas.codec import CONFLUENT, CONFLUENT_CONTENT_TYPE, CONTENT_TYPE, CURRENT

from .config import PublisherConfig

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer

log = logging.getLogger("kvwire.producer")

Headers = list[tuple[str, bytes]]

HEADERS: Headers = [
    ("content-type", CONTENT_TYPE.encode()),
    ("schema", CURRENT.name.encode()),
    ("fingerprint", CURRENT.fingerprint_hex.encode()),
]


@dataclass(frozen=True)
class Connection:
    producer: AIOKafkaProducer
    num_partitions: int
    headers: Headers
    # Confluent framing: the registry's id for CURRENT; None for single-object framing.
    schema_id: int | None


async def connect(cfg: PublisherConfig, closing: Callable[[], bool]) -> Connection | None:
    """Retries until Kafka (and, for Confluent framing, the registry) answers; None if closing
    came first. Records meanwhile wait in the bounded queue and then count as a gap."""
    from aiokafka import AIOKafkaProducer

    failures = registry_failures = 0
    framed: tuple[int, Headers] | None = None
    while not closing():
        producer = AIOKafkaProducer(
            bootstrap_servers=cfg.bootstrap_servers,
            # Idempotence: acks=all and order kept across retries, so no duplicates and no
            # reordering within a rank's partition; the seq check downstream relies on both.
            enable_idempotence=True,
            linger_ms=cfg.linger_ms,
            max_batch_size=cfg.max_batch_size,
            compression_type=cfg.compression_type,
            **cfg.client_options,
        )
        try:
            # Resolved once: a later broker failure does not ask the registry again.
            if cfg.framing == CONFLUENT and framed is None:
                try:
                    framed = await _confluent_headers(cfg, loud=registry_failures == 0)
                except Exception:
                    registry_failures += 1
                    raise
            await producer.start()
            await _ensure_topic(cfg)
            parts = await producer.partitions_for(cfg.topic)
            log.info(
                "publisher connected to %s, topic %s (%d partitions)", cfg.bootstrap_servers, cfg.topic, len(parts)
            )
            if framed is None:
                return Connection(producer, len(parts), HEADERS, None)
            return Connection(producer, len(parts), framed[1], framed[0])
        except Exception as e:
            failures += 1
            # Once loudly, then quietly: the watchdog reports the outage itself.
            log.log(
                logging.WARNING if failures == 1 else logging.DEBUG,
                "Kafka producer start failed (%s: %s); retrying",
                type(e).__name__,
                e,
            )
            try:
                await asyncio.wait_for(producer.stop(), 5)
            except Exception:
                pass
            await asyncio.sleep(cfg.retry_backoff_s)
    return None


async def _confluent_headers(cfg: PublisherConfig, *, loud: bool) -> tuple[int, Headers]:
    """Registers (or looks up) the current version under the subject; a refusal (409) is
    retried like an outage."""
    from kvwire.kafka.registry.client import RegistryClient, RegistryConfig, topic_subject
    from kvwire.kafka.registry.shipped import writer_id

    reg = RegistryConfig.from_env(cfg.schema_registry_url)
    if reg is None:
        raise ValueError("framing='confluent' needs schema_registry_url or KVWIRE_SCHEMA_REGISTRY_URL")
    subject = cfg.schema_subject or topic_subject(cfg.topic)
    try:
        sid = await asyncio.to_thread(writer_id, RegistryClient(reg), subject, CURRENT, cfg.auto_register_schema)
    except Exception as e:
        # Once loudly, then quietly (retried every retry_backoff_s, like the broker).
        level = logging.ERROR if loud else logging.DEBUG
        log.log(level, "schema registry %s: no id for %s under %s: %s", reg.url, CURRENT.name, subject, e)
        raise
    headers = [
        ("content-type", CONFLUENT_CONTENT_TYPE.encode()),
        ("schema", CURRENT.name.encode()),
        ("schema-id", str(sid).encode()),
    ]
    log.info("publisher frames records as Confluent, %s = schema id %d under %s", CURRENT.name, sid, subject)
    return sid, headers


async def _ensure_topic(cfg: PublisherConfig) -> None:
    from kvwire.kafka.topics import Replication, ensure_topic

    await ensure_topic(
        cfg.bootstrap_servers,
        cfg.topic,
        cfg.partitions,
        replication=Replication.from_env(
            replication_factor=cfg.replication_factor, min_insync_replicas=cfg.min_insync_replicas
        ),
        client_options=cfg.client_options,
    )
