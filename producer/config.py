"""Every publisher default lives here, each with the reason it has that value."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

# aiokafka's codecs (each needs cramjam but gzip); None sends batches uncompressed.
COMPRESSION_TYPES = (None, "gzip", "snappy", "lz4", "zstd")


@dataclass
class PublisherConfig:
    bootstrap_servers: str = "127.0.0.1:19092"
    topic: str = "kvwire.events"
    # Used only when the topic does not exist yet.
    partitions: int = 12
    # None: $KVWIRE_REPLICATION_FACTOR, else min(3, registered brokers) (kvwire.kafka.topics).
    replication_factor: int | None = None
    # None: $KVWIRE_MIN_INSYNC_REPLICAS, else 2 from three replicas on (kvwire.kafka.topics).
    min_insync_replicas: int | None = None
    # An explicit partition (e.g. the worker ordinal) instead of murmur2(key) % partitions.
    partition: int | None = None
    # Linger holds only batches that aiokafka builds itself. The sender builds its own, one per
    # partition per pass, and closes each before handing it over, so aiokafka sends it at once:
    # bench.lag at 8k blocks/s gave lag p50 2.24/2.22 ms with linger 1 and 2.20/2.13 ms with 20.
    # Kept small so that nothing aiokafka batches on its own ever waits long.
    linger_ms: int = 1
    max_batch_size: int = 512 * 1024
    # None: kvwire's records are mostly 64-bit block hashes, which no codec shrinks. On
    # bench.lag's records (16 blocks, ~690 B) zstd, the best of aiokafka's codecs here (it
    # compresses at level 3, lz4 at level 9, neither settable), gives 1.30-1.38x in 4-16-record
    # batches for 3-6 us more CPU a record on the engine host and 1-3 us in every member that
    # fetches it. At 512k blocks/s offered (5 alternating pairs, DESIGN.md "Event-to-index
    # lag"): publisher CPU a record 18.0 -> 15.0 us, member 15.5 -> 14.2, lag p50 5.6 -> 4.9 ms,
    # p99 (median of pairs) 14.6 -> 10.5 ms. Set "zstd" where broker disk or network costs more
    # than that CPU; consumers read any codec, mixed in one topic.
    compression_type: str | None = None
    # Batches held between publish() and the producer; the engine never waits on this.
    queue_size: int = 10_000
    # No acknowledgement for this long while records wait => new batches are dropped (and
    # counted into the next record's gap) instead of piling up behind a dead cluster.
    unreachable_timeout_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    # While traffic flows the loop polls the buffer this often, so publish() never makes a
    # syscall: waking an asyncio loop writes to a socket, which drops the GIL mid-call and costs
    # the engine up to a switch interval (5 ms). It adds ~1 ms of lag on average.
    poll_interval_s: float = 0.002
    # Quiet this long, the loop stops polling; the next publish() pays one wake-up.
    sleep_after_idle_s: float = 0.5
    close_timeout_s: float = 10.0
    # Pause between attempts when the producer cannot start or a send is refused.
    retry_backoff_s: float = 0.5
    # Passed to AIOKafkaProducer as is (SASL, TLS, client_id, request_timeout_ms, ...).
    client_options: dict[str, Any] = field(default_factory=dict)
    # Wire framing: "single-object" (C3 01 + fingerprint; names its own schema, no registry) or
    # "confluent" (00 + registry id; what Connect's AvroConverter, ksqlDB and Confluent's or
    # Apicurio's serdes read). Consumers read both, mixed in one topic.
    framing: str = "single-object"
    # Confluent-compatible registry API for framing="confluent" (None: $KVWIRE_SCHEMA_REGISTRY_URL;
    # basic-auth credentials always from $KVWIRE_SCHEMA_REGISTRY_USERNAME/_PASSWORD).
    schema_registry_url: str | None = None
    # None: TopicNameStrategy, "<topic>-value", the subject Confluent's tools look under.
    schema_subject: str | None = None
    # False: the current version must already be registered (e.g. by `kvwire schemas --register`)
    # and the producer only looks its id up.
    auto_register_schema: bool = True

    def __post_init__(self) -> None:
        if self.queue_size < 1:
            raise ValueError("queue_size must be >= 1")
        if self.partitions < 1:
            raise ValueError("partitions must be >= 1")
        if self.partition is not None and self.partition < 0:
            raise ValueError("partition must be >= 0")
        if self.heartbeat_interval_s <= 0 or self.unreachable_timeout_s <= 0:
            raise ValueError("heartbeat_interval_s and unreachable_timeout_s must be > 0")
        if self.compression_type not in COMPRESSION_TYPES:
            raise ValueError(f"compression_type must be one of {COMPRESSION_TYPES}, not {self.compression_type!r}")
        if self.framing not in ("single-object", "confluent"):
            raise ValueError(f"framing must be 'single-object' or 'confluent', not {self.framing!r}")
        if self.framing == "confluent" and not (
            self.schema_registry_url or os.environ.get("KVWIRE_SCHEMA_REGISTRY_URL")
        ):
            raise ValueError("framing='confluent' needs schema_registry_url or KVWIRE_SCHEMA_REGISTRY_URL")
