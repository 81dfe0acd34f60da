"""Index members built through a real broker: equal to the simulator's ground
truth, in both deployment modes, with malformed records dead-lettered."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from kvwire.consumer.http import make_app, serve
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.producer.simulator import SimConfig, Simulator
from kvwire.schemas import codec
from kvwire.schemas.events import EventBatch, WorkerId, stored

pytestmark = pytest.mark.integration


def run_simulation(bootstrap, topic, partitions, steps=300, **sim_kw) -> Simulator:
    """Simulated fleet → real publisher → topic; returns the simulator (ground truth)."""
    pub = KafkaPublisher(PublisherConfig(bootstrap_servers=bootstrap, topic=topic, partitions=partitions, linger_ms=1))
    streams = {}
    cfg = SimConfig(**{"workers": 6, "capacity_blocks": 150, "p_clear": 0.01, "p_restart": 0.01, "seed": 3, **sim_kw})
    sim = Simulator(cfg, lambda rank, evs: streams[rank].publish(evs), on_restart=lambda r: streams[r].new_epoch())
    for ranks in sim.ranks:
        for r in ranks:
            streams[r] = pub.stream(r, "simulator")
    sim.run(steps)
    pub.close()
    stats = pub.stats()
    assert sum(s.dropped + s.lost + s.failed for s in stats) == 0, stats
    assert sim.restarts and sim.clears, "the workload must exercise epochs and clears"
    return sim


async def wait_ready(*members, timeout=60.0):
    for _ in range(int(timeout / 0.1)):
        if all(m.ready for m in members):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"members not ready: {[(m.assigned, m.applier.positions) for m in members]}")


def assert_matches_simulator(score_fn, workers_stats, sim: Simulator, requests=40):
    bs = sim.cfg.block_size
    for w, (inst, dp) in enumerate(sim.workers):
        held = workers_stats.get((inst, dp))
        n = sum(held.blocks.values()) if held is not None else 0
        assert n == len(sim.caches[w]), f"worker {inst}/{dp}: index {n} blocks, engine {len(sim.caches[w])}"
    rng = random.Random(0)
    for _ in range(requests):
        req = sim.next_request()
        tokens = req.token_ids
        if rng.random() < 0.3:
            tokens = tokens[: rng.randrange(len(tokens) + 1)]
        got = {
            (s["instance_id"], s["dp_rank"]) if isinstance(s, dict) else (s.instance_id, s.dp_rank): (
                s["matched_tokens"] if isinstance(s, dict) else s.matched_tokens
            )
            for s in score_fn(list(tokens))
        }
        want = {sim.workers[w]: sim.prefix_blocks(w, tokens) * bs for w in range(len(sim.workers))}
        want = {k: v for k, v in want.items() if v}
        assert got == want


async def test_own_group_member_equals_ground_truth(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=4)
    sim = await asyncio.to_thread(run_simulation, kafka_bootstrap, topic, 4, tp_size=2)
    member = IndexMember(IngestConfig(kafka_bootstrap, topic))
    await member.start()
    try:
        await wait_ready(member)
        assert member.assigned == {0, 1, 2, 3}
        assert_matches_simulator(member.applier.score, member.applier.index.workers(), sim)
        ws = member.applier.workers()
        assert all(w["trusted"] and w["tp_size"] == 2 and len(w["ranks"]) == 2 for w in ws)
        # The gauges, set at most every GAUGE_INTERVAL_S while busy, settle once polls are idle.
        m = member.applier.metrics
        for _ in range(50):
            if m.index_holder_blocks._value.get() == len(member.applier.index):
                break
            await asyncio.sleep(0.1)
        assert m.index_holder_blocks._value.get() == len(member.applier.index) > 0
        assert m.workers.labels("true")._value.get() == len(ws)
    finally:
        await member.stop()


async def _post(session, url, body):
    async with session.post(url, json=body) as r:
        return r.status, await r.json()


async def test_shared_group_scatter_gather_equals_full_index(kafka_bootstrap, new_topic, unused_tcp_port_factory):
    topic = new_topic(partitions=6)
    sim = await asyncio.to_thread(run_simulation, kafka_bootstrap, topic, 6, steps=250, workers=8)
    group = f"g-{topic}"
    a = IndexMember(IngestConfig(kafka_bootstrap, topic, group_id=group))
    await a.start()
    await wait_ready(a)
    assert a.assigned == set(range(6))
    b = IndexMember(IngestConfig(kafka_bootstrap, topic, group_id=group))
    await b.start()  # joining forces a rebalance: a must give up partitions and drop their workers
    full = IndexMember(IngestConfig(kafka_bootstrap, topic))
    await full.start()
    pa, pb = unused_tcp_port_factory(), unused_tcp_port_factory()
    runners = []
    try:
        for _ in range(300):
            if a.assigned and b.assigned and a.assigned | b.assigned == set(range(6)) and a.ready and b.ready:
                break
            await asyncio.sleep(0.1)
        assert a.assigned and b.assigned and not (a.assigned & b.assigned), (a.assigned, b.assigned)
        await wait_ready(a, b, full)
        # a dropped the workers of the partitions it gave away
        wa = {(w["instance_id"], w["dp_rank"]) for w in a.applier.workers()}
        wb = {(w["instance_id"], w["dp_rank"]) for w in b.applier.workers()}
        assert wa and wb and not (wa & wb)
        assert wa | wb == {(w["instance_id"], w["dp_rank"]) for w in full.applier.workers()}
        runners.append(
            await serve(make_app(a.applier, lambda: a.ready, peers=[f"http://127.0.0.1:{pb}"]), "127.0.0.1", pa)
        )
        runners.append(await serve(make_app(b.applier, lambda: b.ready), "127.0.0.1", pb))
        async with aiohttp.ClientSession() as s:
            for _ in range(25):
                tokens = list(sim.next_request().token_ids)
                status, merged = await _post(s, f"http://127.0.0.1:{pa}/v1/score", {"token_ids": tokens})
                assert status == 200 and merged["partial"] is False
                want = [(x.instance_id, x.dp_rank, x.matched_tokens, x.score) for x in full.applier.score(tokens)]
                assert [
                    (x["instance_id"], x["dp_rank"], x["matched_tokens"], x["score"]) for x in merged["scores"]
                ] == want
        assert_matches_simulator(full.applier.score, full.applier.index.workers(), sim, requests=10)
    finally:
        for r in runners:
            await r.cleanup()
        for m in (a, b, full):
            await m.stop()


async def test_malformed_records_are_dead_lettered_and_ingest_goes_on(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    good = EventBatch(WorkerId("w1"), 5, 0, 1, (stored([1, 2], range(32), 16),), reset=True)
    good2 = EventBatch(WorkerId("w1"), 5, 1, 2, (stored([3], range(32, 48), 16, parent_block_hash=2),))
    bad = [
        b"",
        b"\xc3\x01garbage!!",
        codec.encode(good)[:-4],
        b"\x00\x00\x00\x00\x01" + b"confluent",
        codec.encode(good) + b"x",
    ]
    p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await p.start()
    try:
        await p.send_and_wait(topic, codec.encode(good), key=b"w1/0", partition=0)
        for i, v in enumerate(bad):
            await p.send_and_wait(topic, v, key=f"bad{i}".encode(), partition=i % 2)
        await p.send_and_wait(topic, codec.encode(good2), key=b"w1/0", partition=0)
    finally:
        await p.stop()
    member = IndexMember(IngestConfig(kafka_bootstrap, topic))
    await member.start()
    try:
        await wait_ready(member)
        assert member.applier.score(list(range(48)))[0].matched_tokens == 48
        assert member.applier.metrics.dead_letters._value.get() == len(bad)
    finally:
        await member.stop()
    c = AIOKafkaConsumer(
        f"{topic}.dlq", bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await c.start()
    try:
        got = []
        while len(got) < len(bad):
            for recs in (await c.getmany(timeout_ms=5000)).values():
                got.extend(recs)
    finally:
        await c.stop()
    assert sorted(r.value for r in got) == sorted(bad)
    where = set()
    for r in got:
        h = dict(r.headers)
        assert h["kvwire-source-topic"].decode() == topic and h["kvwire-error"]
        assert r.key.startswith(b"bad")
        where.add((int(h["kvwire-source-partition"]), int(h["kvwire-source-offset"])))
    # partition 0: good@0, bad@1..3, good@4; partition 1: bad@0..1
    assert where == {(0, 1), (0, 2), (0, 3), (1, 0), (1, 1)}


async def test_a_member_started_before_its_topic_exists_picks_it_up(kafka_bootstrap):
    """`kvwire index` may start before any producer created the topic: it must see the topic
    once it exists (a metadata refresh away), not minutes later."""
    import uuid

    from kafka_admin import delete_topics

    topic = f"t-late-{uuid.uuid4().hex[:8]}"
    member = IndexMember(IngestConfig(kafka_bootstrap, topic))
    await member.start()
    try:
        await asyncio.sleep(2)  # subscribed to a topic that is not there yet
        assert not member.assigned
        w = WorkerId("late", 0)

        def publish() -> None:
            with KafkaPublisher(PublisherConfig(kafka_bootstrap, topic, partitions=2)) as pub:
                pub.stream(w).publish([stored([1, 2], range(32), 16)])

        await asyncio.to_thread(publish)
        await wait_ready(member, timeout=60)
        for _ in range(600):
            if member.applier.score(list(range(32))):
                break
            await asyncio.sleep(0.1)
        assert [(s.instance_id, s.matched_tokens) for s in member.applier.score(list(range(32)))] == [("late", 32)]
    finally:
        await member.stop()
        await delete_topics(kafka_bootstrap, [topic])
