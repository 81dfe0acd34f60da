"""Fault 5: the producer's buffer overflows. The batches it drops are owned up to as the next
record's gap; the index keeps applying the worker's records but no longer trusts it: it scores
nothing and /v1/workers says why. The worker's next reset (a new epoch) makes it trusted again.

The overflow is real publisher code under a real burst: the publisher's loop thread is stalled
(as a long GC pause or a slow send would) while the engine keeps publishing past queue_size.
Deterministic under any load: the stall lasts until the burst is over (not a fixed time), and
every other step runs in chunks flushed in between, so only the burst can overflow the buffer."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer
from oracle_feed import (
    Fleet,
    build_expected,
    diff_index,
    read_log,
    record_result,
    score_requests,
    sim_blocks,
    wait_until,
)

from kvwire.consumer.http import make_app
from kvwire.consumer.ingest import IndexMember, IngestConfig

pytestmark = pytest.mark.integration

QUEUE = 64


def _stall_publisher(fleet: Fleet, release: threading.Event) -> None:
    """Block the publisher's loop until ``release`` is set (bounded, so a failing test ends)."""
    started = threading.Event()

    def stall() -> None:
        started.set()
        release.wait(120)

    fleet.pub._loop.call_soon_threadsafe(stall)
    assert started.wait(60), "publisher loop never ran the stall"


# Steps per chunk outside the burst: with 3 workers, 20 steps stay well under QUEUE records
# (the warm-up checks that nothing is refused), and the buffer is flushed after each chunk.
CHUNK = 20


async def _run_flushed(fleet: Fleet, steps: int) -> None:
    while steps > 0:
        n = min(CHUNK, steps)
        await asyncio.to_thread(fleet.run, n)
        steps -= n
        await wait_until(lambda: fleet.in_flight() == 0, 60, "fleet flushed")


async def _state(client: TestClient, fleet: Fleet, prompts):
    r = await client.get("/v1/workers")
    assert r.status == 200
    workers = {(w["instance_id"], w["dp_rank"]): w for w in (await r.json())["workers"]}
    scores = []
    for toks in prompts:
        r = await client.post("/v1/score", json={"token_ids": toks})
        assert r.status == 200
        scores.append(
            [(x["instance_id"], x["dp_rank"], x["matched_tokens"], x["score"]) for x in (await r.json())["scores"]]
        )
    return workers, scores


async def test_overflow_gap_untrusts_until_next_reset(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    fleet = await asyncio.to_thread(
        Fleet,
        kafka_bootstrap,
        topic,
        2,
        sim={"workers": 3, "p_restart": 0.0, "p_clear": 0.0, "seed": 51},
        pub={"queue_size": QUEUE, "heartbeat_interval_s": 3600},
    )
    member = IndexMember(IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=600))
    await member.start()
    client = TestClient(TestServer(make_app(member.applier, lambda: member.ready)))
    await client.start_server()
    try:
        sim = fleet.sim
        w = 0
        victim = sim.workers[w]
        stream = fleet.streams[sim.ranks[w][0]]
        # Warm-up in small steps: the buffer is small on purpose and must not overflow yet.
        await wait_until(lambda: fleet.acked_count() >= len(fleet.streams), 60, "publisher connected")
        await _run_flushed(fleet, 5 * CHUNK)
        assert fleet.refused == 0
        prompts = [list(sim.system_prompts[i]) for i in range(len(sim.system_prompts))] + score_requests(sim, 20)

        # The burst: the victim serves requests while its publisher cannot drain.
        def burst() -> int:
            release = threading.Event()
            _stall_publisher(fleet, release)
            try:
                for _ in range(3 * QUEUE):
                    sim.serve(w, sim.next_request().token_ids)
                return fleet.in_flight()
            finally:
                release.set()

        in_flight = await asyncio.to_thread(burst)
        assert in_flight == QUEUE  # the buffer was full when the burst ended
        await wait_until(lambda: fleet.in_flight() == 0, 60, "stall over, buffer drained")
        dropped = stream.stats().dropped
        assert dropped > 0 and fleet.refused == dropped
        # The gap rides on the victim's next record.
        await asyncio.to_thread(sim.serve, w, sim.next_request().token_ids)
        await _run_flushed(fleet, 30)
        assert sum(s.gap_sent for s in fleet.pub.stats()) == dropped
        records = await read_log(kafka_bootstrap, topic)
        mid = build_expected(records, list(fleet.acks), fleet.epochs)
        assert mid.acked_lost == 0 and mid.untrusted == {victim}
        t0 = time.monotonic()
        await wait_until(lambda: diff_index(member.applier.index, mid) is None, 60, "member equal to the oracle")
        untrusted_s = time.monotonic() - t0

        workers, scores = await _state(client, fleet, prompts)
        v = workers[victim]
        assert v["trusted"] is False
        reasons = [r["untrusted_reason"] for r in v["ranks"]]
        assert all(r and f"producer lost {dropped} batch(es)" in r for r in reasons), reasons
        assert all(x["trusted"] for k, x in workers.items() if k != victim)
        for toks, got in zip(prompts, scores, strict=False):
            assert got == mid.score(toks)
            assert victim not in {(i, d) for i, d, _, _ in got}
        # Its blocks are still indexed (the next reset replaces them); they just do not score.
        assert v["blocks"] == mid.blocks_per_worker().get(victim, 0)

        # The worker restarts: a new epoch, its reset record, trusted again.
        t_reset = time.monotonic()
        sim.restart(w)
        await _run_flushed(fleet, 100)
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(s.lost + s.failed for s in stats) == 0 and sum(s.dropped for s in stats) == dropped
        records = await read_log(kafka_bootstrap, topic)
        exp = build_expected(records, fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0 and exp.duplicates == 0 and not exp.untrusted
        # After the reset the acknowledged records tell the engines' whole story again.
        assert exp.blocks_per_worker() == sim_blocks(sim)

        async def trusted_again() -> bool:
            ws, _ = await _state(client, fleet, [])
            return ws[victim]["trusted"] and diff_index(member.applier.index, exp) is None

        await wait_until(trusted_again, 60, "victim trusted again and equal to the oracle")
        converge_s = time.monotonic() - t_reset
        workers, scores = await _state(client, fleet, prompts)
        assert all(x["trusted"] and all(r["untrusted_reason"] is None for r in x["ranks"]) for x in workers.values())
        for toks, got in zip(prompts, scores, strict=False):
            assert got == exp.score(toks)
        assert any(victim in {(i, d) for i, d, _, _ in got} for got in scores), "the victim scores again"
        record_result(
            "producer_overflow_gap",
            records_in_flight_at_fault=in_flight,
            batches_dropped=dropped,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            untrusted_observed_s_after_flush=untrusted_s,
            converge_s_after_new_epoch=converge_s,
        )
    finally:
        await client.close()
        fleet.close(5)
        await member.stop()
