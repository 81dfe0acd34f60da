"""Fault 1: the broker is SIGKILLed mid-stream and restarted on the same data dir.

Producers keep publishing through the outage (the publisher buffers and retries), an index
member keeps running through it (its consumer reconnects and rejoins), and once the workload is
over the member equals the oracle fed every acknowledged record; no acknowledged record is lost.
A private broker (tests/faults/conftest.py's factory): the shared one on 19092 is never killed."""

from __future__ import annotations

import asyncio
import time

import pytest
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

pytestmark = pytest.mark.integration


async def test_broker_sigkill_mid_stream_member_converges(private_brokers):
    kafka = await asyncio.to_thread(private_brokers.single)
    bootstrap = kafka.bootstrap
    topic = "faults-broker-kill"
    fleet = member = None
    try:
        fleet = await asyncio.to_thread(
            Fleet, bootstrap, topic, 4, sim={"tp_size": 2, "seed": 11}, pub={"heartbeat_interval_s": 1.0}
        )
        await asyncio.to_thread(fleet.run, 50)
        await wait_until(lambda: fleet.acked_count() >= 50, 60, "first acknowledgements")
        member = IndexMember(IngestConfig(bootstrap, topic, heartbeat_timeout_s=600))
        await member.start()
        await wait_until(lambda: member.ready, 60, "member caught up before the fault")

        fleet.start(pace_s=0.003)
        await wait_until(lambda: fleet.acked_count() >= 400 and member.applier.records >= 300, 60, "traffic")
        acked_at_kill = fleet.acked_count()
        in_flight = fleet.in_flight()
        t_kill = time.monotonic()
        await asyncio.to_thread(kafka.kill)
        # Hold the outage long enough that the publisher really buffers and the consumer really
        # loses its connections and group, not just one request.
        await asyncio.sleep(0.5)
        await asyncio.to_thread(kafka.start)
        t_back = time.monotonic()
        buffered = fleet.in_flight()
        outage = t_back - t_kill
        # Recovery: the backlog drains, new records keep being acknowledged, the member applies
        # records again.
        await wait_until(lambda: fleet.acked_count() >= acked_at_kill + buffered, 120, "publisher backlog drained")
        await wait_until(lambda: member.applier.records >= acked_at_kill + buffered, 120, "member applied the backlog")
        catch_up = time.monotonic() - t_back
        await wait_until(lambda: fleet.acked_count() >= acked_at_kill + buffered + 150, 120, "traffic after")
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(s.dropped + s.lost + s.failed for s in stats) == 0, stats
        assert fleet.refused == 0

        records = await read_log(bootstrap, topic)
        exp = build_expected(records, fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0 and exp.duplicates == 0, (exp.acked_lost, exp.duplicates)
        assert exp.acked_records == sum(s.acked for s in stats) == len(records)
        assert not exp.untrusted and not exp.notes, (exp.untrusted, exp.notes)
        # Nothing published was lost, so the acknowledged records are the engines' whole story.
        assert exp.blocks_per_worker() == sim_blocks(fleet.sim)

        converge = await wait_until(
            lambda: diff_index(member.applier.index, exp) is None, 120, "member equal to the oracle"
        )
        converge_from_back = time.monotonic() - t_back
        assert member.applier.index.digest() == exp.digest()
        assert all(w["trusted"] for w in member.applier.workers())
        assert_scores(applier_scores(member.applier), exp, score_requests(fleet.sim, 40))
        assert member.applier.metrics.dead_letters._value.get() == 0
        record_result(
            "broker_sigkill_restart",
            records_in_flight_at_fault=in_flight,
            records_buffered_during_outage=buffered,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            duplicates_in_log=exp.duplicates,
            outage_s=outage,
            member_caught_up_s_after_broker_back=catch_up,
            converge_s_after_broker_back=converge_from_back,
            converge_s_after_workload_end=converge,
        )
    finally:
        if fleet is not None:
            await asyncio.to_thread(fleet.close, 5)
        if member is not None:
            await member.stop()
        await asyncio.to_thread(kafka.stop)
