"""Fault 3: index members join and leave under load, in both deployment modes.

- shared group: members split the partitions; every join/leave is a rebalance. After the churn no
  partition is owned twice, the members' indexes are disjoint by worker and their union is the
  oracle, and a scatter-gather score through any member equals the oracle's score;
- own group each: every member holds the full index, whatever it joined or left around.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from oracle_feed import (
    Fleet,
    build_expected,
    diff_index,
    diff_union,
    end_offsets,
    free_port,
    read_log,
    record_result,
    score_requests,
    sim_blocks,
    wait_until,
)

from kvwire.consumer.http import make_app, serve
from kvwire.consumer.ingest import IndexMember, IngestConfig

pytestmark = pytest.mark.integration

PARTITIONS = 6
# Joins (+) and leaves (-) fired under load, a second or so apart: rebalances overlap.
CHURN = ["+a", "+b", "+c", "-b", "+d", "-a", "+e"]


def _owned(m: IndexMember) -> set[int]:
    """What the member's consumer owns. Mid-rebalance aiokafka still lists the previous assignment
    although it has revoked it (eager protocol: every partition is revoked before rejoining) until
    the new one is installed; a member in that state owns nothing."""
    c = m.membership.consumer
    if c is None or c._subscription.reassignment_in_progress:
        return set()
    return {tp.partition for tp in c.assignment()}


async def _lag(bootstrap, topic, members) -> int:
    """Records in the log that no live member has applied yet."""
    ends = await end_offsets(bootstrap, topic)
    pos = {}
    for m in members:
        for p in _owned(m):
            pos[p] = max(pos.get(p, 0), m.applier.positions.get(p, 0))
    return sum(max(0, e - pos.get(p, 0)) for p, e in ends.items())


@pytest.mark.parametrize("mode", ["shared_group", "own_groups"])
async def test_members_join_and_leave_under_load(kafka_bootstrap, new_topic, mode):
    topic = new_topic(partitions=PARTITIONS)
    shared = mode == "shared_group"
    group = f"g-{topic}" if shared else None
    fleet = await asyncio.to_thread(
        Fleet, kafka_bootstrap, topic, PARTITIONS, sim={"workers": 12, "seed": 31}, pub={"heartbeat_interval_s": 1.0}
    )
    members: dict[str, IndexMember] = {}
    overlaps: list[tuple] = []
    runners = []
    sampling = True

    async def sample() -> None:
        # No partition may ever be owned by two live members of one group, not even mid-churn.
        while sampling:
            seen: dict[int, str] = {}
            for name, m in list(members.items()):
                for p in _owned(m):
                    if p in seen:
                        overlaps.append((p, seen[p], name))
                    seen[p] = name
            await asyncio.sleep(0.02)

    sampler = asyncio.create_task(sample()) if shared else None
    lags = []
    try:
        await asyncio.to_thread(fleet.run, 100)
        fleet.start(pace_s=0.003)
        for step in CHURN:
            name = step[1:]
            lags.append(await _lag(kafka_bootstrap, topic, members.values()))
            if step[0] == "+":
                m = IndexMember(IngestConfig(kafka_bootstrap, topic, group_id=group, heartbeat_timeout_s=600))
                await m.start()
                members[name] = m
            else:
                await members.pop(name).stop()
            await asyncio.sleep(1.0)
        t_churn_end = time.monotonic()
        live = list(members.values())

        def settled() -> bool:
            owned = [_owned(m) for m in live]
            if shared:
                ok = all(owned) and set().union(*owned) == set(range(PARTITIONS)) and sum(map(len, owned)) == PARTITIONS
            else:
                ok = all(o == set(range(PARTITIONS)) for o in owned)
            return ok and all(m.assigned == o for m, o in zip(live, owned, strict=False)) and all(m.ready for m in live)

        await wait_until(settled, 120, "group settled after the churn")
        settle_s = time.monotonic() - t_churn_end
        await asyncio.sleep(0.5)
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(x.dropped + x.lost + x.failed for x in stats) == 0, stats
        records = await read_log(kafka_bootstrap, topic)
        exp = build_expected(records, fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0 and exp.duplicates == 0
        assert exp.blocks_per_worker() == sim_blocks(fleet.sim)

        if shared:
            await wait_until(
                lambda: diff_union([m.applier.index for m in live], exp) is None,
                120,
                "union of the members equal to the oracle",
            )
        else:
            await wait_until(
                lambda: all(diff_index(m.applier.index, exp) is None for m in live),
                120,
                "every member equal to the oracle",
            )
        converge_s = time.monotonic() - t_churn_end
        assert not overlaps, f"partitions owned twice: {overlaps[:10]}"
        owned = [_owned(m) for m in live]
        if shared:
            assert sum(map(len, owned)) == PARTITIONS and set().union(*owned) == set(range(PARTITIONS))
            # a member knows only the workers of its own partitions
            workers = [{(w["instance_id"], w["dp_rank"]) for w in m.applier.workers()} for m in live]
            assert sum(map(len, workers)) == len(set().union(*workers)) == len(exp.workers)
        else:
            for m in live:
                assert m.applier.index.digest() == exp.digest()

        # The router's view: a score through any member (scatter-gather in shared mode).
        ports = [free_port() for _ in live]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for i, (m, port) in enumerate(zip(live, ports, strict=False)):
            peers = [u for j, u in enumerate(urls) if j != i] if shared else []
            runners.append(await serve(make_app(m.applier, lambda m=m: m.ready, peers=peers), "127.0.0.1", port))
        async with aiohttp.ClientSession() as s:
            for k, toks in enumerate(score_requests(fleet.sim, 30)):
                async with s.post(f"{urls[k % len(urls)]}/v1/score", json={"token_ids": toks}) as r:
                    assert r.status == 200
                    body = await r.json()
                assert not body.get("partial", False)
                got = [(x["instance_id"], x["dp_rank"], x["matched_tokens"], x["score"]) for x in body["scores"]]
                assert got == exp.score(toks)
        record_result(
            f"rebalance_{mode}",
            churn_events=len(CHURN),
            records_in_flight_at_faults_max=max(lags),
            records_in_flight_at_faults_sum=sum(lags),
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            partitions_owned_twice=len(overlaps),
            settle_s_after_churn=settle_s,
            converge_s_after_churn=converge_s,
        )
    finally:
        sampling = False
        if sampler is not None:
            await sampler
        for r in runners:
            await r.cleanup()
        fleet.close(5)
        for m in members.values():
            await m.stop()
