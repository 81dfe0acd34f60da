"""The broker under every integration test is a real Kafka: groups rebalance, offsets persist,
idempotent producers are accepted, and the log survives a crash."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from ci_env import need_java_and_mvn
from kafka_admin import create_topics, free_port_pair

pytestmark = pytest.mark.integration


def _consumer(bootstrap: str, group: str, *topics: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        session_timeout_ms=10000,
        heartbeat_interval_ms=500,
    )


async def _produce(bootstrap: str, topic: str, partitions: int, per_partition: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await producer.start()
    try:
        futs = [
            await producer.send(topic, f"{p}:{i}".encode(), partition=p)
            for i in range(per_partition)
            for p in range(partitions)
        ]
        metas = await asyncio.gather(*futs)
    finally:
        await producer.stop()
    # Idempotent, in-order writes: each partition holds exactly offsets 0..n-1.
    for p in range(partitions):
        assert sorted(m.offset for m in metas if m.partition == p) == list(range(per_partition))


async def test_group_members_split_partitions(kafka_bootstrap, new_topic):
    topic, group = new_topic(partitions=4), f"g-{os.urandom(4).hex()}"
    c1, c2 = _consumer(kafka_bootstrap, group, topic), _consumer(kafka_bootstrap, group, topic)
    await c1.start()
    await c2.start()
    try:
        # Both members must keep polling for the eager rebalance to complete.
        async with asyncio.timeout(60):
            while True:
                await asyncio.gather(c1.getmany(timeout_ms=200), c2.getmany(timeout_ms=200))
                a1, a2 = c1.assignment(), c2.assignment()
                if a1 and a2 and not (a1 & a2) and len(a1 | a2) == 4:
                    break
        assert {tp.partition for tp in a1 | a2} == {0, 1, 2, 3}

        await _produce(kafka_bootstrap, topic, 4, 25)
        got: dict[AIOKafkaConsumer, list] = {c1: [], c2: []}
        async with asyncio.timeout(60):
            while sum(map(len, got.values())) < 100:
                for c, batch in zip(
                    (c1, c2), await asyncio.gather(c1.getmany(timeout_ms=200), c2.getmany(timeout_ms=200)), strict=False
                ):
                    for tp, recs in batch.items():
                        assert tp in c.assignment(), "record from a partition the member does not own"
                        got[c].extend((tp.partition, r.offset) for r in recs)
        everything = got[c1] + got[c2]
        assert got[c1] and got[c2]
        assert len(everything) == len(set(everything)) == 100
    finally:
        await c1.stop()
        await c2.stop()


async def test_committed_offsets_survive_consumer_restart(kafka_bootstrap, new_topic):
    topic, group = new_topic(partitions=4), f"g-{os.urandom(4).hex()}"
    await _produce(kafka_bootstrap, topic, 4, 10)
    tps = [TopicPartition(topic, p) for p in range(4)]

    first = _consumer(kafka_bootstrap, group, topic)
    await first.start()
    seen: set[tuple[int, int]] = set()
    try:
        async with asyncio.timeout(60):
            while len(seen) < 15:
                for tp, recs in (await first.getmany(timeout_ms=500, max_records=15 - len(seen))).items():
                    seen.update((tp.partition, r.offset) for r in recs)
        commit = {TopicPartition(topic, p): max(o for q, o in seen if q == p) + 1 for p in {p for p, _ in seen}}
        await first.commit(commit)
        for tp, off in commit.items():
            assert await first.committed(tp) == off
    finally:
        await first.stop()

    second = _consumer(kafka_bootstrap, group, topic)
    await second.start()
    rest: list[tuple[int, int]] = []
    try:
        async with asyncio.timeout(60):
            while len(rest) < 40 - len(seen):
                for tp, recs in (await second.getmany(timeout_ms=500)).items():
                    rest.extend((tp.partition, r.offset) for r in recs)
        # Nothing beyond the remainder arrives: no re-delivery of committed records.
        extra = await second.getmany(timeout_ms=1000)
        assert not any(extra.values())
        for tp in tps:
            offs = sorted(o for p, o in rest if p == tp.partition)
            start = commit.get(tp, 0)
            assert offs == list(range(start, 10)), f"{tp}: resumed at {offs[:1]}, committed {start}"
    finally:
        await second.stop()
    assert seen.isdisjoint(rest) and len(seen) + len(rest) == 40


def _need_toolchain() -> None:
    need_java_and_mvn("the local broker")


def test_cli_start_is_idempotent():
    _need_toolchain()
    lines = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-m", "kvwire.cli", "kafka", "start"], capture_output=True, text=True, timeout=180
        )
        assert r.returncode == 0, r.stderr
        lines.append(r.stdout.strip().splitlines()[-1])
    assert lines[0] == lines[1]
    host, _, port = lines[0].rpartition(":")
    assert host == "127.0.0.1" and port.isdigit()
    r = subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "kafka", "status"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr


async def test_fresh_start_empties_the_log_only_when_it_launches_the_broker(tmp_path):
    """CI starts with --fresh: leftover topics from earlier runs are gone, but a broker that
    already runs (someone's) is used as it is, its topics kept."""
    _need_toolchain()
    from aiokafka.admin import AIOKafkaAdminClient

    home, port = str(tmp_path / "kafka"), str(free_port_pair())

    said: list[str] = []

    def kvwire_kafka(*args: str) -> str:
        r = subprocess.run(
            [sys.executable, "-m", "kvwire.cli", "kafka", *args, "--home", home, "--port", port],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert r.returncode == 0, r.stderr
        said.append(r.stderr)
        return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""

    async def topics(bootstrap: str) -> set[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            return {t for t in await admin.list_topics() if not t.startswith("__")}
        finally:
            await admin.close()

    try:
        bootstrap = kvwire_kafka("start")
        await create_topics(bootstrap, ["left-over"], partitions=1)
        assert kvwire_kafka("start", "--fresh") == bootstrap
        assert "already runs" in said[-1] and "its log kept" in said[-1]
        assert await topics(bootstrap) == {"left-over"}
        kvwire_kafka("stop")
        assert kvwire_kafka("start") == bootstrap  # a plain start keeps the log
        assert await topics(bootstrap) == {"left-over"}
        kvwire_kafka("stop")
        assert kvwire_kafka("start", "--fresh") == bootstrap
        assert await topics(bootstrap) == set()
    finally:
        kvwire_kafka("stop")


async def test_killed_broker_restarts_with_its_log(tmp_path):
    """A private broker (own home and port) so SIGKILL never disturbs the shared one."""
    _need_toolchain()
    from kvwire.kafka.broker import LocalKafka

    kafka = LocalKafka(tmp_path / "kafka", free_port_pair())
    try:
        bootstrap = await asyncio.to_thread(kafka.start)
        await _produce(bootstrap, "crash", 1, 20)
        await asyncio.to_thread(kafka.kill)
        assert kafka.pid() is None and not kafka.status().running
        assert await asyncio.to_thread(kafka.start) == bootstrap
        c = _consumer(bootstrap, "g", "crash")
        await c.start()
        got = []
        try:
            async with asyncio.timeout(60):
                while len(got) < 20:
                    for recs in (await c.getmany(timeout_ms=500)).values():
                        got.extend(r.value for r in recs)
        finally:
            await c.stop()
        assert got == [f"0:{i}".encode() for i in range(20)]
    finally:
        kafka.stop()
    assert kafka.pid() is None


async def test_cluster_id_with_leading_dash_formats_and_serves(tmp_path):
    """About 1 random Kafka id in 64 starts with "-", which StorageTool's `-t ID` read as an option
    (the broker then never started). Our ids never start with one, and one given by a caller works."""
    _need_toolchain()
    from aiokafka.admin import AIOKafkaAdminClient

    from kvwire.kafka.broker import LocalKafka
    from kvwire.kafka.broker.local import new_cluster_id

    assert not any(new_cluster_id().startswith("-") for _ in range(2000))
    cid = "-kvwire-dash-cluster-B"
    kafka = LocalKafka(tmp_path / "kafka", free_port_pair(), cluster_id=cid)
    try:
        bootstrap = await asyncio.to_thread(kafka.start)
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            assert (await admin.describe_cluster())["cluster_id"] == cid
        finally:
            await admin.close()
    finally:
        kafka.stop()
