"""Creating kvwire's topics: the one place that does it (events, dead letters, snapshots, tests).

Replication comes from configuration, never from a constant: ``replication_factor`` and
``min_insync_replicas`` passed in, else ``$KVWIRE_REPLICATION_FACTOR`` and
``$KVWIRE_MIN_INSYNC_REPLICAS``, else the defaults below. The default replication factor is
min(3, registered brokers): three copies where the cluster has them, and a single dev broker
still works. Registered, not live: a broker down for a restart still counts (DescribeCluster
v2, kvwire.kafka.describe_cluster), so a topic created meanwhile still gets three replicas
(KRaft places one on the fenced broker, which catches up when it is back) instead of two for
the topic's life. The default ``min.insync.replicas`` is 2 from three replicas on (an acks=all
write then survives the loss of any one broker without being refused), 1 below.

A topic that already exists is left as it is (its partitions are returned): kvwire never
changes an operator's topic.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .describe_cluster import registered_brokers

log = logging.getLogger(__name__)

RF_ENV = "KVWIRE_REPLICATION_FACTOR"
MIN_ISR_ENV = "KVWIRE_MIN_INSYNC_REPLICAS"
MAX_DEFAULT_RF = 3


class TopicError(RuntimeError):
    """The broker refused to create a topic (the error names it and the broker's reason)."""


@dataclass(frozen=True)
class Replication:
    replication_factor: int | None = None  # None: min(3, registered brokers)
    min_insync_replicas: int | None = None  # None: 2 from RF 3 on, else 1

    def __post_init__(self) -> None:
        rf, isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and rf < 1:
            raise ValueError("replication factor must be >= 1")
        if isr is not None and isr < 1:
            raise ValueError("min.insync.replicas must be >= 1")
        if rf is not None and isr is not None and isr > rf:
            raise ValueError(f"min.insync.replicas {isr} exceeds the replication factor {rf}: no write could succeed")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, **explicit: int | None) -> Replication:
        """Explicit values (not None) win over the environment."""

        def pick(key: str, var: str) -> int | None:
            if explicit.get(key) is not None:
                return explicit[key]
            raw = (env.get(var) or "").strip()
            if not raw:
                return None
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{var} must be an integer, not {raw!r}") from None

        return cls(pick("replication_factor", RF_ENV), pick("min_insync_replicas", MIN_ISR_ENV))

    def resolve(self, brokers: int) -> tuple[int, int]:
        """(replication factor, min.insync.replicas) for a cluster of ``brokers``."""
        rf = self.replication_factor or max(1, min(MAX_DEFAULT_RF, brokers))
        isr = self.min_insync_replicas or (2 if rf >= 3 else 1)
        if isr > rf:
            raise ValueError(f"min.insync.replicas {isr} exceeds the replication factor {rf}")
        return rf, isr


async def cluster_brokers(admin: Any) -> int:
    """Brokers registered with the cluster, fenced (down) ones included; brokers before Kafka
    4.0 cannot say, and then the ones up now are counted."""
    registered = await registered_brokers(admin)
    if registered is None:
        desc = await admin.describe_cluster()
        return len(desc.get("brokers") or ()) or 1
    return len(registered) or 1


async def partition_count(admin: Any, topic: str) -> int | None:
    """Partitions of ``topic``, or None when it does not exist (or cannot be described)."""
    try:
        desc = await admin.describe_topics([topic])
    except Exception:
        return None
    for t in desc:
        if t.get("topic") == topic and t.get("error_code", 0) == 0 and t.get("partitions"):
            return len(t["partitions"])
    return None


async def ensure_topics(
    bootstrap: str,
    names: list[str],
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    *,
    replication: Replication | None = None,
    client_options: Mapping[str, Any] | None = None,
    timeout_ms: int = 30000,
) -> dict[str, int]:
    """Create each missing topic; returns name -> partitions for all of them.

    Raises :class:`TopicError` when the broker refuses one (an existing topic, also one made
    concurrently by another member, is not an error)."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    from kvwire.kafka.options import admin_options

    repl = replication if replication is not None else Replication.from_env()
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **admin_options(client_options or {}))
    await admin.start()
    try:
        # Describe only what exists: a metadata request for a missing topic makes a broker with
        # auto.create.topics.enable create it, with the broker's defaults instead of ours.
        existing = set(await admin.list_topics())
        have = {n: await partition_count(admin, n) if n in existing else None for n in names}
        missing = [n for n, p in have.items() if p is None]
        if missing:
            rf, isr = repl.resolve(await cluster_brokers(admin))
            cfg = {"min.insync.replicas": str(isr), **(config or {})}
            resp = await admin.create_topics(
                [NewTopic(n, partitions, rf, topic_configs=cfg) for n in missing], timeout_ms
            )
            errors = []
            for t in resp.topic_errors:
                name, code = t[0], t[1]
                if code == 0 or code == TopicAlreadyExistsError.errno:
                    continue
                msg = t[2] if len(t) > 2 and t[2] else for_code(code).__name__
                errors.append(f"{name}: {msg}")
            if errors:
                raise TopicError(f"cannot create topic(s) (replication factor {rf}): {'; '.join(errors)}")
            log.info(
                "created %s: %d partition(s), replication factor %d, min.insync.replicas %d",
                missing,
                partitions,
                rf,
                isr,
            )
            for n in missing:
                have[n] = await partition_count(admin, n) or partitions
        return {n: int(p) for n, p in have.items() if p is not None}
    finally:
        await admin.close()


async def ensure_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    **kw: Any,
) -> int:
    """:func:`ensure_topics` for one topic; returns its partition count."""
    return (await ensure_topics(bootstrap, [name], partitions, config, **kw))[name]
