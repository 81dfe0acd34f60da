"""Fault 4: a worker restarts (new epoch) and a zombie of its old incarnation flushes late records
after the new epoch's reset: stores, removes, clears and even a reset of the dead epoch, written
with a raw producer exactly as the old publisher would have framed them. The index ignores them:
a member that saw them live and one that replays the whole log both equal the oracle, which never
saw them (they were never acknowledged to the fleet)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaProducer
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
from kvwire.producer.partitioner import default_partition
from kvwire.producer.publisher import HEADERS
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, stored

pytestmark = pytest.mark.integration

PARTITIONS = 3


def _zombie_batches(fleet: Fleet, w: int, old: dict, ts_us: int) -> list[tuple]:
    """Late records of the dead incarnations of worker ``w``: (rank, batch) pairs."""
    sim = fleet.sim
    bs = sim.cfg.block_size
    prompt = sim.system_prompts[0]
    chain = sim.block_chain(prompt)
    held_now = list(sim.caches[w])[:8]
    out = []
    for rank in sim.ranks[w]:
        for epoch, last_seq in old[rank.rank]:
            seq = last_seq + 1
            events = [
                (stored([eh for eh, _ in chain], prompt[: len(chain) * bs], bs),),  # would make it score
                (BlockRemoved(tuple(held_now)),) if held_now else (),  # would forget live blocks
                (AllBlocksCleared(),),  # would wipe the new incarnation
            ]
            for i, evs in enumerate(events):
                out.append((rank, EventBatch(rank, epoch, seq + i, ts_us, evs, source="zombie")))
            # a zombie that believes it just started
            out.append((rank, EventBatch(rank, epoch, 0, ts_us, (AllBlocksCleared(),), reset=True, source="zombie")))
    return out


async def test_late_records_of_the_old_epoch_are_ignored(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=PARTITIONS)
    fleet = await asyncio.to_thread(
        Fleet, kafka_bootstrap, topic, PARTITIONS, sim={"workers": 4, "tp_size": 2, "p_restart": 0.0, "seed": 41}
    )
    live = IndexMember(IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=600))
    cold = None
    await live.start()
    try:
        w = 1
        ranks = fleet.sim.ranks[w]
        old: dict[tuple, list[tuple[int, int]]] = {r.rank: [] for r in ranks}
        # Two restarts: zombies of the previous incarnation and of the one before it.
        for _ in range(2):
            await asyncio.to_thread(fleet.run, 150)
            await wait_until(lambda: fleet.in_flight() == 0, 60, "fleet flushed")
            for r in ranks:
                st = fleet.streams[r].stats()
                old[r.rank].append((st.epoch, st.next_seq - 1))
            fleet.sim.restart(w)
            await asyncio.to_thread(fleet.run, 30)
        await wait_until(lambda: fleet.in_flight() == 0, 60, "new epoch acknowledged")
        acked_before = fleet.acked_count()
        await wait_until(lambda: live.applier.records >= acked_before, 60, "live member applied the new epoch")
        new_epochs = {r.rank: fleet.streams[r].epoch for r in ranks}
        assert all(live.applier.ranks.ranks[k].epoch == e for k, e in new_epochs.items())

        skipped_before = live.applier.metrics.skipped.labels("stale_epoch")._value.get()
        zombies = _zombie_batches(fleet, w, old, time.time_ns() // 1000)
        part = default_partition(ranks[0].kafka_key(), PARTITIONS)
        p = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await p.start()
        try:
            for _, b in zombies:
                await p.send_and_wait(topic, codec.encode(b), key=b.worker.kafka_key(), partition=part, headers=HEADERS)
        finally:
            await p.stop()
        t_zombie = time.monotonic()
        await asyncio.to_thread(fleet.run, 150)  # the new incarnation goes on after the zombie
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(x.dropped + x.lost + x.failed for x in stats) == 0, stats

        records = await read_log(kafka_bootstrap, topic)
        exp = build_expected(records, fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0 and exp.duplicates == 0
        assert exp.acked_records == len(records) - len(zombies)
        assert exp.blocks_per_worker() == sim_blocks(fleet.sim)
        assert len(fleet.epochs[ranks[0].rank]) == 3

        await wait_until(lambda: diff_index(live.applier.index, exp) is None, 60, "live member equal to the oracle")
        converge_s = time.monotonic() - t_zombie
        stale = live.applier.metrics.skipped.labels("stale_epoch")._value.get() - skipped_before
        assert stale == len(zombies)
        cold = IndexMember(IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=600))
        await cold.start()
        await wait_until(lambda: cold.ready, 60, "cold member replayed the log")
        for m in (live, cold):
            assert diff_index(m.applier.index, exp) is None
            assert m.applier.index.digest() == exp.digest()
            ws = {(x["instance_id"], x["dp_rank"]): x for x in m.applier.workers()}
            victim = ws[fleet.sim.workers[w]]
            assert victim["trusted"] and {r["epoch"] for r in victim["ranks"]} == set(new_epochs.values())
            assert_scores(
                applier_scores(m.applier), exp, score_requests(fleet.sim, 20) + [list(fleet.sim.system_prompts[0])]
            )
        assert cold.applier.metrics.skipped.labels("stale_epoch")._value.get() == len(zombies)
        record_result(
            "worker_restart_zombie_records",
            records_in_flight_at_fault=len(zombies),
            zombie_records_ignored=int(stale),
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            converge_s_after_zombie=converge_s,
        )
    finally:
        fleet.close(5)
        for m in (live, cold):
            if m is not None:
                await m.stop()
