"""Every publisher default lives here, each with the reason it has that value."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any


def _default_compression() -> str:
    # Measured on encoded EventBatches in 64 KiB chunks (aiokafka codecs, this 2-core box):
    # zstd ratio 3.5 at ~116 MB/s, gzip 3.8 at ~2 MB/s, lz4 3.4 at ~7 MB/s, snappy 2.4 at
    # ~370 MB/s. zstd compresses nearly as well as gzip at ~50x its speed, and the cramjam wheel
    # needs no system library. gzip is the stdlib fallback when cramjam is absent.
    try:
        from aiokafka.codec import has_zstd

        return "zstd" if has_zstd() else "gzip"
    except Exception:  # pragma: no cover - aiokafka always ships has_zstd
        return "gzip"


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
    # Linger is lag every record pays while the pipeline is not busy; when it is, batches fill
    # behind the one request in flight per broker anyway. bench.lag (one host, 64 workers):
    # 5 -> 1 ms took lag p50/p99 from 9.4/13.5 to 5.7/8.4 ms at 64k blocks/s, and 511k blocks/s
    # from saturated (0.949 applied) to keeping up (0.997); publisher CPU a record at 26-32k
    # records/s stayed 29-32 us. The member fetches more often at low loads (more CPU a record).
    linger_ms: int = 1
    max_batch_size: int = 512 * 1024
    compression_type: str | None = field(default_factory=_default_compression)
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
        if self.framing not in ("single-object", "confluent"):
            raise ValueError(f"framing must be 'single-object' or 'confluent', not {self.framing!r}")
        if self.framing == "confluent" and not (
            self.schema_registry_url or os.environ.get("KVWIRE_SCHEMA_REGISTRY_URL")
        ):
            raise ValueError("framing='confluent' needs schema_registry_url or KVWIRE_SCHEMA_REGISTRY_URL")
