"""Faults on a replicated three-broker KRaft cluster (kvwire.kafka.broker.cluster, tests/faults/conftest.py).

Every topic here is created by kvwire itself (publisher, dead-letter topic, snapshot store), so
these tests also check that kvwire's default replication holds: replication factor 3 and
min.insync.replicas 2 on three live brokers. With acks=all (the idempotent publisher) an
acknowledged record is on at least two replicas, so losing any one broker loses none of them:

- the leader of the partitions in use is SIGKILLed mid-stream;
- all three brokers are restarted one after the other under load;
- the broker leading the dead-letter and snapshot topics is lost: both still hold everything.

Each compares the member's index with the oracle fed every acknowledged record, and records its
measurements (oracle_feed.record_result). One more checks that a seek to the log start, right
after leadership moved back, reads the log (kvwire.kafka.positions)."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from kafka_admin import create_topics
from oracle_feed import (
    Fleet,
    applier_scores,
    assert_scores,
    build_expected,
    diff_index,
    read_log,
    record_result,
    score_requests,
    sim_blocks,
    wait_until,
)

from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.consumer.snapshot import snapshot_store
from kvwire.kafka.broker import probe
from kvwire.kafka.positions import seek_to_beginning

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- cluster helpers


async def partitions(bootstrap: str, topic: str) -> list[dict]:
    """Per partition: leader, replicas, isr (broker ids)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        desc = await admin.describe_topics([topic])
    finally:
        await admin.close()
    return sorted((p for t in desc if t["topic"] == topic for p in t["partitions"]), key=lambda p: p["partition"])


async def topic_config(bootstrap: str, topic: str, name: str) -> str | None:
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        resp = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])
    finally:
        await admin.close()
    for r in resp:
        for res in r.resources:
            for entry in res[4]:
                if entry[0] == name:
                    return entry[1]
    return None


async def assert_replicated(bootstrap: str, topic: str) -> None:
    """kvwire's defaults on three live brokers: three replicas, two of them in sync to ack."""
    parts = await partitions(bootstrap, topic)
    assert parts, f"{topic} does not exist"
    assert all(len(p["replicas"]) == 3 for p in parts), (topic, parts)
    assert await topic_config(bootstrap, topic, "min.insync.replicas") == "2"


async def wait_fully_replicated(bootstrap: str, topics: list[str], timeout: float = 120) -> float:
    async def full() -> bool:
        for t in topics:
            for p in await partitions(bootstrap, t):
                if len(p["isr"]) < len(p["replicas"]) or p["leader"] < 0:
                    return False
        return True

    return await wait_until(full, timeout, f"every replica of {topics} back in sync", every=0.5)


async def start_member(bootstrap: str, topic: str, **kw) -> IndexMember:
    member = IndexMember(IngestConfig(bootstrap, topic, heartbeat_timeout_s=600), **kw)
    await member.start()
    await wait_until(lambda: member.ready, 120, "member caught up")
    return member


async def check_against_oracle(fleet: Fleet, member: IndexMember, bootstrap: str, topic: str, stats):
    """The acknowledged records are all in the log once, and the member equals their oracle."""
    assert sum(s.dropped + s.lost + s.failed for s in stats) == 0, stats
    assert fleet.refused == 0
    records = await read_log(bootstrap, topic)
    exp = build_expected(records, fleet.acks, fleet.epochs)
    assert exp.acked_lost == 0 and exp.duplicates == 0, (exp.acked_lost, exp.duplicates)
    assert exp.acked_records == sum(s.acked for s in stats) == len(records)
    assert not exp.untrusted and not exp.notes, (exp.untrusted, exp.notes)
    assert exp.blocks_per_worker() == sim_blocks(fleet.sim)
    converge = await wait_until(lambda: diff_index(member.applier.index, exp) is None, 180, "member equal to oracle")
    assert member.applier.index.digest() == exp.digest()
    assert all(w["trusted"] for w in member.applier.workers())
    assert_scores(applier_scores(member.applier), exp, score_requests(fleet.sim, 30))
    return exp, converge


# ---------------------------------------------------------------- faults


async def test_a_topic_made_while_a_broker_is_down_still_gets_three_replicas(kafka_cluster):
    """Counting the brokers that are up gave a topic created during a restart two replicas for
    its whole life. kvwire counts the registered ones (DescribeCluster v2): the down broker gets
    its replica, fenced, and catches up once it is back."""
    from kvwire.kafka.describe_cluster import registered_brokers
    from kvwire.kafka.topics import ensure_topics

    node = 0
    topic = f"faults-made-while-down-{uuid.uuid4().hex[:8]}"
    up = ",".join(n.bootstrap for i, n in enumerate(kafka_cluster.nodes) if i != node)
    await asyncio.to_thread(kafka_cluster.kill_node, node)
    try:

        async def fenced() -> bool:
            desc = await probe.describe_cluster(up)
            return node + 1 not in {b["node_id"] for b in desc["brokers"]}

        await wait_until(fenced, 60, "the killed broker fenced", every=0.5)
        admin = AIOKafkaAdminClient(bootstrap_servers=up)
        await admin.start()
        try:
            registered = await registered_brokers(admin)
        finally:
            await admin.close()
        assert registered == {1: True, 2: False, 3: False}
        await ensure_topics(up, [topic], 2)
        parts = await partitions(up, topic)
        assert [len(p["replicas"]) for p in parts] == [3, 3], parts
        assert all(node + 1 not in p["isr"] for p in parts)
    finally:
        await asyncio.to_thread(kafka_cluster.start_node, node)
    await wait_fully_replicated(kafka_cluster.bootstrap, [topic])
    await assert_replicated(kafka_cluster.bootstrap, topic)


async def test_a_restarted_node_serves_once_start_node_returns(kafka_cluster):
    """The other faults restart what they kill and the next test trusts three live brokers: a
    start_node that returned while the new JVM was still starting (the dead incarnation was still
    listed) let the next test create its topic on two."""
    node = len(kafka_cluster.nodes) - 1
    await asyncio.to_thread(kafka_cluster.kill_node, node)
    await asyncio.to_thread(kafka_cluster.start_node, node)
    # Its own listener serves only once it has caught up and been unfenced: its view is current.
    desc = await probe.describe_cluster(kafka_cluster.nodes[node].bootstrap)
    assert {b["node_id"] for b in desc["brokers"]} == set(range(1, len(kafka_cluster.nodes) + 1))


async def test_partition_leader_killed_mid_stream(kafka_cluster):
    bootstrap = kafka_cluster.bootstrap
    topic = f"faults-leader-kill-{uuid.uuid4().hex[:8]}"
    fleet = member = None
    killed = None
    try:
        # One partition: every record goes through the leader we kill.
        fleet = await asyncio.to_thread(
            Fleet, bootstrap, topic, 1, sim={"tp_size": 2, "seed": 31}, pub={"heartbeat_interval_s": 1.0}
        )
        await asyncio.to_thread(fleet.run, 50)
        await wait_until(lambda: fleet.acked_count() >= 50, 120, "first acknowledgements")
        await assert_replicated(bootstrap, topic)
        member = await start_member(bootstrap, topic)

        fleet.start(pace_s=0.003)
        await wait_until(lambda: fleet.acked_count() >= 400 and member.applier.records >= 300, 120, "traffic")
        leader = (await partitions(bootstrap, topic))[0]["leader"]
        killed = kafka_cluster.node_of(leader)
        acked_at_kill = fleet.acked_count()
        in_flight = fleet.in_flight()
        t_kill = time.monotonic()
        await asyncio.to_thread(kafka_cluster.kill_node, killed)
        # acks=all still succeeds on the two remaining in-sync replicas: no waiting for the node.
        failover = await wait_until(lambda: fleet.acked_count() >= acked_at_kill + 200, 120, "acks after failover")
        new_leader = (await partitions(bootstrap, topic))[0]["leader"]
        assert new_leader != leader and new_leader > 0
        await wait_until(lambda: member.applier.records >= acked_at_kill + 200, 120, "member applies after failover")
        member_s = time.monotonic() - t_kill
        stats = await asyncio.to_thread(fleet.close, 60)
        exp, converge = await check_against_oracle(fleet, member, bootstrap, topic, stats)
        converge_from_kill = time.monotonic() - t_kill
        record_result(
            "cluster_leader_sigkill",
            brokers=3,
            replication_factor=3,
            min_insync_replicas=2,
            records_in_flight_at_fault=in_flight,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            duplicates_in_log=exp.duplicates,
            first_200_acks_after_kill_s=failover,
            member_applying_s_after_kill=member_s,
            converge_s_after_fault=converge_from_kill,
            converge_s_after_workload_end=converge,
        )
    finally:
        if fleet is not None:
            await asyncio.to_thread(fleet.close, 5)
        if member is not None:
            await member.stop()
        if killed is not None:
            await asyncio.to_thread(kafka_cluster.start_node, killed)


async def test_a_seek_after_leadership_moved_back_reads_the_log(kafka_cluster):
    """A client learns a partition's leader while its preferred leader is down; the leader then
    moves back. aiokafka's own seek_to_beginning asked the stale leader, got "not leader" and
    asked it again until its next metadata refresh, 5 min away by default (the rolling restart
    test's log reader timed out so). kvwire's seek (kafka/positions.py) reads the log at once."""
    bootstrap = kafka_cluster.bootstrap
    topic = f"faults-seek-{uuid.uuid4().hex[:8]}"
    await create_topics(bootstrap, [topic], partitions=1)

    async def led() -> bool:  # the broker the admin asks may not know a new topic yet
        return any(p["leader"] > 0 for p in await partitions(bootstrap, topic))

    await wait_until(led, 60, "the new topic has a leader", every=0.2)
    await assert_replicated(bootstrap, topic)
    prod = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)
    await prod.start()
    try:
        for i in range(20):
            await prod.send_and_wait(topic, b"%d" % i, partition=0)
    finally:
        await prod.stop()
    preferred = (await partitions(bootstrap, topic))[0]["leader"]
    down: int | None = kafka_cluster.node_of(preferred)
    tp = TopicPartition(topic, 0)
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)  # metadata refresh: 5 min
    try:
        await asyncio.to_thread(kafka_cluster.stop_node, down)  # controlled shutdown: leadership moves
        await c.start()
        c.assign([tp])
        await c.end_offsets([tp])  # the client learns the leader of the moment
        interim = c._client.cluster.leader_for_partition(tp)
        assert interim not in (None, -1, preferred)
        await asyncio.to_thread(kafka_cluster.start_node, down)
        down = None

        async def moved_back() -> bool:
            return (await partitions(bootstrap, topic))[0]["leader"] == preferred

        await wait_until(moved_back, 120, "leadership back on the preferred replica", every=0.5)
        assert c._client.cluster.leader_for_partition(tp) == interim  # the client's view is stale
        got: list[bytes] = []
        async with asyncio.timeout(60):
            await seek_to_beginning(c, tp)
            while len(got) < 20:
                for recs in (await c.getmany(tp, timeout_ms=500)).values():
                    got.extend(r.value for r in recs)
        assert got == [b"%d" % i for i in range(20)]
    finally:
        await c.stop()
        if down is not None:
            await asyncio.to_thread(kafka_cluster.start_node, down)


async def test_rolling_restart_under_load(kafka_cluster):
    bootstrap = kafka_cluster.bootstrap
    topic = f"faults-rolling-{uuid.uuid4().hex[:8]}"
    fleet = member = None
    down = None
    try:
        fleet = await asyncio.to_thread(
            Fleet, bootstrap, topic, 3, sim={"seed": 41, "workers": 6}, pub={"heartbeat_interval_s": 1.0}
        )
        await asyncio.to_thread(fleet.run, 50)
        await wait_until(lambda: fleet.acked_count() >= 50, 120, "first acknowledgements")
        await assert_replicated(bootstrap, topic)
        member = await start_member(bootstrap, topic)
        fleet.start(pace_s=0.003)
        await wait_until(lambda: fleet.acked_count() >= 300, 120, "traffic")
        t0 = time.monotonic()
        in_flight = []
        for i in range(len(kafka_cluster.nodes)):
            before = fleet.acked_count()
            in_flight.append(fleet.in_flight())
            down = i
            # A rolling restart is graceful: controlled shutdown hands leadership over first.
            await asyncio.to_thread(kafka_cluster.stop_node, i)
            await wait_until(lambda b=before: fleet.acked_count() >= b + 100, 120, f"acks while node {i} is down")
            await asyncio.to_thread(kafka_cluster.start_node, i)
            down = None
            # The next node goes down only once every replica is back in sync, as an operator does.
            await wait_fully_replicated(bootstrap, [topic, "__consumer_offsets"])
        rolling_s = time.monotonic() - t0
        await wait_until(lambda: member.applier.records >= fleet.acked_count() - 50, 120, "member keeps up")
        stats = await asyncio.to_thread(fleet.close, 60)
        exp, converge = await check_against_oracle(fleet, member, bootstrap, topic, stats)
        record_result(
            "cluster_rolling_restart",
            brokers=3,
            replication_factor=3,
            min_insync_replicas=2,
            records_in_flight_at_fault=max(in_flight),
            records_in_flight_at_each_restart=in_flight,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            duplicates_in_log=exp.duplicates,
            rolling_restart_s=rolling_s,
            converge_s_after_fault=time.monotonic() - t0,
            converge_s_after_workload_end=converge,
        )
    finally:
        if fleet is not None:
            await asyncio.to_thread(fleet.close, 5)
        if member is not None:
            await member.stop()
        if down is not None:
            await asyncio.to_thread(kafka_cluster.start_node, down)


async def test_dead_letters_and_snapshots_survive_a_broker_loss(kafka_cluster, tmp_path):
    """The broker leading the dead-letter and snapshot topics dies while poison records are still
    being dead-lettered and snapshots written. Once a dead letter is acknowledged the member
    commits past its source record, so the DLQ copy is the only one: every one must still be there.
    A cold member then restores from the snapshot topic with that broker still down."""
    bootstrap = kafka_cluster.bootstrap
    topic = f"faults-dlq-snap-{uuid.uuid4().hex[:8]}"
    dlq = f"{topic}.dlq"
    snap_topic = f"{topic}.snapshots"
    fleet = member = cold = None
    killed = None
    half = 150
    rng = random.Random(5)
    prod = AIOKafkaProducer(bootstrap_servers=bootstrap, enable_idempotence=True)

    async def poison(first: int, n: int) -> None:
        # Values no decoder accepts: each must end up as a dead letter.
        for i in range(first, first + n):
            await prod.send_and_wait(topic, b"\xff" + rng.randbytes(rng.randrange(1, 64)), key=b"poison%d" % i)

    try:
        await prod.start()
        fleet = await asyncio.to_thread(Fleet, bootstrap, topic, 2, sim={"seed": 51}, pub={"heartbeat_interval_s": 1.0})
        await asyncio.to_thread(fleet.run, 150)
        await wait_until(lambda: fleet.acked_count() >= 150, 120, "first acknowledgements")
        snaps = snapshot_store(bootstrap, topic, interval_s=0.2, every_records=50)
        member = await start_member(bootstrap, topic, snapshots=snaps)
        await poison(0, half)
        await wait_until(lambda: member.applier.metrics.dead_letters._value.get() >= half, 120, "dead letters sent")
        fleet.start(pace_s=0.005)
        await wait_until(lambda: snaps.saved >= 2, 120, "snapshots written")
        for t in (dlq, snap_topic):
            await assert_replicated(bootstrap, t)

        # Mid-stream: the second half of the poison is on its way when the broker goes.
        leaders = [p["leader"] for t in (dlq, snap_topic) for p in await partitions(bootstrap, t)]
        victim = max(set(leaders), key=leaders.count)
        killed = kafka_cluster.node_of(victim)
        second = asyncio.create_task(poison(half, half))
        await wait_until(lambda: member.applier.metrics.dead_letters._value.get() >= half + 20, 120, "more poison")
        in_flight = fleet.in_flight() + len(member.applier.dead_letters)
        saved_at_kill = snaps.saved
        t_kill = time.monotonic()
        await asyncio.to_thread(kafka_cluster.kill_node, killed)
        await second
        await wait_until(
            lambda: member.applier.metrics.dead_letters._value.get() >= 2 * half, 120, "every dead letter sent"
        )
        await wait_until(lambda: snaps.saved > saved_at_kill + 2, 120, "snapshots written after the loss")
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(s.dropped + s.lost + s.failed for s in stats) == 0, stats
        records = await read_log(bootstrap, topic)
        exp = build_expected(records, fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0
        await wait_until(lambda: diff_index(member.applier.index, exp) is None, 120, "member equal to oracle")
        assert member.healthy
        await member.stop()  # a clean stop snapshots every partition it holds, at the log end
        member = None
        await wait_until(
            lambda: _led_elsewhere(bootstrap, [dlq, snap_topic], victim), 120, "new leaders for DLQ and snapshots"
        )

        letters = await read_log(bootstrap, dlq)
        assert len(letters) >= 2 * half  # a retried send may duplicate a dead letter, never lose one
        assert {r.key for r in letters} >= {b"poison%d" % i for i in range(2 * half)}

        # A cold member restores from the snapshot topic while the broker is still down.
        cold_snaps = snapshot_store(bootstrap, topic)
        cold = await start_member(bootstrap, topic, snapshots=cold_snaps)
        assert cold_snaps.loaded == 2 and cold_snaps.rejected == 0, (cold_snaps.loaded, cold_snaps.rejected)
        converge = await wait_until(lambda: diff_index(cold.applier.index, exp) is None, 120, "cold member = oracle")
        assert cold.applier.index.digest() == exp.digest()
        record_result(
            "cluster_dlq_snapshot_broker_loss",
            brokers=3,
            replication_factor=3,
            min_insync_replicas=2,
            records_in_flight_at_fault=in_flight,
            dead_letters_written=2 * half,
            dead_letters_read_after_loss=len(letters),
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            snapshots_loaded_after_loss=cold_snaps.loaded,
            converge_s_after_fault=time.monotonic() - t_kill,
            converge_s_cold_member=converge,
        )
    finally:
        await prod.stop()
        if fleet is not None:
            await asyncio.to_thread(fleet.close, 5)
        for m in (member, cold):
            if m is not None:
                await m.stop()
        if killed is not None:
            await asyncio.to_thread(kafka_cluster.start_node, killed)


async def _led_elsewhere(bootstrap: str, topics: list[str], dead: int) -> bool:
    for t in topics:
        for p in await partitions(bootstrap, t):
            if p["leader"] in (dead, -1):
                return False
    return True
