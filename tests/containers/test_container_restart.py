"""A broker restart in a container: the same container is killed (SIGKILL) or stopped (SIGTERM)
and started again; its log, its cluster id and the group's committed offsets survive, and the
published address does not change. A private container: the session's broker is never restarted."""

from __future__ import annotations

import asyncio
import os

import pytest
import tc_broker
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from ci_env import unavailable

pytestmark = pytest.mark.integration

LEADING_DASH_ID = "-kvwire-dash-cluster-A"  # 22 characters of urlsafe base64, Kafka's Uuid form


async def _cluster_id(bootstrap: str) -> str:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return (await admin.describe_cluster())["cluster_id"]
    finally:
        await admin.close()


@pytest.fixture(scope="module")
def private_container():
    """One container for both restarts (each test uses its own topic and group): a container
    start costs a JVM start."""
    from kvwire.kafka.broker.container import DockerKafka

    tc_broker.need_engine()
    # An id that starts with "-", as about 1 random id in 64 does: the image's format step once
    # read it as an option and the broker never started. It must also survive both restarts.
    kafka = DockerKafka(cluster_id=LEADING_DASH_ID)
    try:
        kafka.start()
    except Exception as e:
        unavailable(f"testcontainers could not start {kafka.image}: {e}")
    try:
        yield kafka
    finally:
        kafka.stop()


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> list[int]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True, acks="all")
    await producer.start()
    try:
        metas = await asyncio.gather(*[await producer.send(topic, v, partition=0) for v in values])
    finally:
        await producer.stop()
    return [m.offset for m in metas]


async def _consume(bootstrap: str, topic: str, group: str | None, n: int) -> list[tuple[int, bytes]]:
    c = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, group_id=group, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await c.start()
    got: list[tuple[int, bytes]] = []
    try:
        async with asyncio.timeout(90):
            while len(got) < n:
                for recs in (await c.getmany(timeout_ms=500)).values():
                    got.extend((r.offset, r.value) for r in recs)
        # Nothing beyond what was asked for: no record re-delivered past a committed offset.
        extra = await c.getmany(timeout_ms=1000)
        got.extend((r.offset, r.value) for recs in extra.values() for r in recs)
        if group is not None and got:
            await c.commit({TopicPartition(topic, 0): got[-1][0] + 1})
    finally:
        await c.stop()
    return got


@pytest.mark.parametrize("how", ["kill", "stop"])
async def test_restarted_container_keeps_log_and_offsets(private_container, how):
    kafka = private_container
    bootstrap = kafka.bootstrap
    topic, group = f"restart-{how}", f"g-{os.urandom(4).hex()}"
    first = [f"a{i}".encode() for i in range(20)]
    assert await _produce(bootstrap, topic, first) == list(range(20))
    # The group reads and commits the first 20 before the fault.
    assert [v for _, v in await _consume(bootstrap, topic, group, 20)] == first

    if how == "kill":
        await asyncio.to_thread(kafka.kill_broker)
    else:
        await asyncio.to_thread(kafka.stop_broker)
    assert not await asyncio.to_thread(kafka.running)
    assert await asyncio.to_thread(kafka.start_broker) == bootstrap

    # Offsets continue where the log left off: the restarted broker has the old log.
    second = [f"b{i}".encode() for i in range(10)]
    assert await _produce(bootstrap, topic, second) == list(range(20, 30))
    # The group resumes at its committed offset: only what came after the restart.
    assert await _consume(bootstrap, topic, group, 10) == list(zip(range(20, 30), second, strict=True))
    # A reader from the beginning sees the whole log, in order, nothing lost or duplicated.
    assert await _consume(bootstrap, topic, None, 30) == list(zip(range(30), first + second, strict=True))
    # The restart kept the formatted log's cluster id, the one that begins with "-".
    assert await _cluster_id(bootstrap) == LEADING_DASH_ID
