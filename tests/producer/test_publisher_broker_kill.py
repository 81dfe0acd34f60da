"""The broker is SIGKILLed and restarted mid-stream. A private broker (own home and port) so the
shared one on 19092 is never disturbed.

Promise under test: every batch publish() accepted lands exactly once, in order; everything it
refused is owned up to by the gaps of later records, one for one."""

from __future__ import annotations

import asyncio
import threading

import pytest
from ci_env import need_java_and_mvn
from kafka_admin import free_port_pair
from test_publisher import by_rank, check_stream, one_block, read_all, wait_for

from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
from kvwire.schemas.events import WorkerId

pytestmark = pytest.mark.integration


async def test_broker_killed_and_restarted_mid_stream(tmp_path):
    need_java_and_mvn()
    from kvwire.kafka.broker import LocalKafka

    kafka = LocalKafka(tmp_path / "kafka", free_port_pair())
    bootstrap = await asyncio.to_thread(kafka.start)
    topic = "kill-test"
    pub = None
    try:
        pub = KafkaPublisher(
            PublisherConfig(
                bootstrap_servers=bootstrap,
                topic=topic,
                partitions=2,
                queue_size=300,
                unreachable_timeout_s=2.0,
                retry_backoff_s=0.1,
                heartbeat_interval_s=3600,
            )
        )
        workers = [WorkerId("kill-a", 0), WorkerId("kill-b", 1)]
        streams = [pub.stream(w) for w in workers]
        results: list[list[tuple[int, bool]]] = [[] for _ in streams]
        stop = threading.Event()

        def engine() -> None:
            i = 0
            while not stop.is_set():
                for s, out in zip(streams, results, strict=False):
                    out.append((i, s.publish(one_block(i))))
                i += 1
                stop.wait(0.001)

        t = threading.Thread(target=engine, daemon=True)
        t.start()
        await asyncio.to_thread(
            wait_for, lambda: min(s.stats().acked for s in streams) >= 300, 60, "traffic before the kill"
        )
        await asyncio.to_thread(kafka.kill)
        # Hold the outage until the buffer overflowed and the cluster was declared unreachable,
        # so both ways of dropping are exercised.
        await asyncio.to_thread(wait_for, lambda: pub.unreachable, 60, "unreachable")
        await asyncio.to_thread(kafka.start)
        await asyncio.to_thread(wait_for, lambda: not pub.unreachable, 120, "recovery")
        mark = [len(r) for r in results]
        await asyncio.to_thread(
            wait_for,
            lambda: all(sum(ok for _, ok in r[m:]) >= 200 for r, m in zip(results, mark, strict=False)),
            60,
            "traffic after the restart",
        )
        stop.set()
        t.join()
        pub.close(timeout=60)

        ranks = by_rank(await read_all(bootstrap, topic, 2))
        for s, w, res in zip(streams, workers, results, strict=False):
            batches = [b for _, b in ranks[w.rank]]
            check_stream(batches)
            accepted = [i for i, ok in res if ok]
            refused = sum(not ok for _, ok in res)
            got = [b.events[0].block_hashes[0] for b in batches if b.events]
            assert got == accepted  # exactly once, in order
            st = s.stats()
            assert refused > 0 and st.dropped == refused and st.lost == 0 and st.failed == 0
            assert sum(b.gap for b in batches) == refused
            assert st.acked == len(batches)
    finally:
        if pub is not None:
            pub.close(timeout=5)
        await asyncio.to_thread(kafka.stop)
