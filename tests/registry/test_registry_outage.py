"""A private registry (its own home and port, the same code as `kvwire registry start`) stopped
and restarted under a running index member: while it is down the member applies nothing past the
first unresolved id and dead-letters nothing; once it is back (with the ids it issued before the
restart, kept on disk) the member catches up to the same index as the records applied directly."""

from __future__ import annotations

import asyncio
import socket

import pytest
from ci_env import need_java_and_mvn, unavailable
from wire_workload import produce, reference, workload

from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.kafka.registry.client import RegistryClient, RegistryConfig, topic_subject
from kvwire.kafka.registry.local import LocalRegistry
from kvwire.kafka.registry.shipped import register_shipped
from kvwire.schemas import codec

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_member_waits_out_a_registry_outage_and_ids_survive_a_restart(kafka_bootstrap, new_topic, tmp_path):
    need_java_and_mvn("a private schema registry")
    reg = LocalRegistry(tmp_path / "registry", _free_port())
    try:
        url = await asyncio.to_thread(reg.start)
    except Exception as e:
        unavailable(f"private schema registry did not start: {e}")
    try:
        topic = new_topic(partitions=1)
        ids = dict(register_shipped(RegistryClient(RegistryConfig(url)), topic_subject(topic)))
        batches = workload(seed=9, batches_per_rank=8)
        half = len(batches) // 2
        # single-object first, then Confluent: the member applies the first half without a registry
        values = [(b.worker.kafka_key(), codec.encode(b)) for b in batches[:half]] + [
            (b.worker.kafka_key(), codec.encode(b, schema_id=ids[codec.CURRENT.version])) for b in batches[half:]
        ]
        await produce(kafka_bootstrap, topic, values)
        await asyncio.to_thread(reg.stop)
        assert not reg.status().running

        member = IndexMember(IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=3600.0, schema_registry_url=url))
        await member.start()
        try:
            a = member.applier
            # Wait until it has polled the Confluent records and asked the registry in vain twice.
            for _ in range(1200):
                if member.schema_ids.unavailable >= 2:
                    break
                await asyncio.sleep(0.1)
            assert member.schema_ids.unavailable >= 2
            assert a.metrics.dead_letters._value.get() == 0
            assert a.records < len(batches) and not member.ready

            assert await asyncio.to_thread(reg.start) == url  # same home: same H2 file, same ids
            for _ in range(900):
                if member.ready:
                    break
                await asyncio.sleep(0.1)
            assert member.ready, (a.records, a.positions)
            assert a.records == len(batches)
            assert a.metrics.dead_letters._value.get() == 0
            assert a.index.digest() == reference(batches).index.digest()
        finally:
            await member.stop()
        client = RegistryClient(RegistryConfig(url))
        assert codec.SchemaIds().add(ids[2], client.schema(ids[2])) is codec.CURRENT
    finally:
        await asyncio.to_thread(reg.stop)
