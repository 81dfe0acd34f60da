"""Fault 8: the member must never freeze silently.

- The snapshot store fails (the real broker refuses to create the snapshot topic): snapshots are
  retried with exponential backoff while ingest keeps applying, so the index still equals the
  oracle; past the failure bound /healthz answers 503 with the reason and
  ``kvwire_index_failed{reason="snapshots_failing"}`` is 1.
- The ingest task dies: /healthz 503, ``kvwire_index_failed{reason="ingest_task_dead"}``.
- ``kvwire index`` whose snapshot directory cannot be written (a full or read-only disk behaves
  the same) exits non-zero, so an orchestrator restarts it."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from oracle_feed import Fleet, build_expected, diff_index, free_port, read_log, record_result, wait_until

from kvwire.consumer.http import make_app
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.consumer.snapshot import KafkaStore, Snapshots

pytestmark = pytest.mark.integration

RETRY_S = 0.05
LIMIT = 3


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def _serve(member: IndexMember) -> TestClient:
    client = TestClient(TestServer(make_app(member.applier, lambda: member.ready, health=lambda: member.failure)))
    await client.start_server()
    return client


async def test_failing_snapshot_store_is_retried_then_unhealthy_while_ingest_goes_on(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=2)
    fleet = await asyncio.to_thread(
        Fleet, kafka_bootstrap, topic, 2, sim={"seed": 61}, pub={"heartbeat_interval_s": 1.0}
    )
    # '/' is not legal in a topic name: the broker itself refuses the snapshot topic, every time.
    store = KafkaStore(kafka_bootstrap, f"{topic}/snapshots", topic)
    snaps = Snapshots(store, interval_s=0.05, every_records=1)
    member = IndexMember(
        IngestConfig(
            kafka_bootstrap,
            topic,
            heartbeat_timeout_s=600,
            snapshot_retry_s=RETRY_S,
            snapshot_retry_max_s=60.0,
            snapshot_failure_limit=LIMIT,
        ),
        snapshots=snaps,
    )
    client = None
    try:
        await asyncio.to_thread(fleet.run, 50)
        await member.start()
        client = await _serve(member)
        await wait_until(lambda: member.ready, 60, "member caught up")
        r = await client.get("/healthz")
        assert r.status == 200 and (await r.json())["healthy"] is True

        fleet.start(pace_s=0.005)
        t0 = time.monotonic()
        await wait_until(lambda: member.failure is not None, 60, "snapshot failures past the bound")
        assert "snapshots_failing" in member.failure
        r = await client.get("/healthz")
        body = await r.json()
        assert r.status == 503 and body["healthy"] is False and "snapshot" in body["failure"], body
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, 'kvwire_index_failed{reason="snapshots_failing"}') == 1.0
        assert _metric(metrics, "kvwire_snapshot_failures_total") >= LIMIT
        assert snaps.saved == 0

        # Ingest kept applying all along: the index still equals the oracle of the acknowledged log.
        applied_at_failure = member.applier.records
        await wait_until(lambda: member.applier.records > applied_at_failure + 50, 60, "ingest goes on")
        stats = await asyncio.to_thread(fleet.close, 60)
        assert sum(s.dropped + s.lost + s.failed for s in stats) == 0
        exp = build_expected(await read_log(kafka_bootstrap, topic), fleet.acks, fleet.epochs)
        assert exp.acked_lost == 0
        converge = await wait_until(lambda: diff_index(member.applier.index, exp) is None, 60, "member = oracle")

        # Backoff: attempts double their spacing, so they grow with log(elapsed), not with elapsed.
        elapsed = time.monotonic() - t0
        attempts = _metric(await (await client.get("/metrics")).text(), "kvwire_snapshot_failures_total")
        assert attempts <= 2 + math.log2(elapsed / RETRY_S + 1), (attempts, elapsed)
        assert member.failure is not None  # still failing: still unhealthy
        record_result(
            "snapshot_store_failing",
            records_in_flight_at_fault=0,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            snapshot_attempts_failed=int(attempts),
            unhealthy_s_after_traffic=round(elapsed, 3),
            converge_s_after_workload_end=converge,
        )
    finally:
        if client is not None:
            await client.close()
        await asyncio.to_thread(fleet.close, 5)
        await member.stop()


async def test_dead_ingest_task_turns_health_red(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1)
    member = IndexMember(IngestConfig(kafka_bootstrap, topic, heartbeat_timeout_s=600))
    client = None
    try:
        await member.start()
        client = await _serve(member)
        await wait_until(lambda: member.ready, 60, "member caught up")
        assert (await client.get("/healthz")).status == 200
        member._task.cancel()  # however it ends (a bug, a cancelled task), nothing applies any more
        await wait_until(lambda: member.failure is not None, 30, "supervisor notices")
        r = await client.get("/healthz")
        body = await r.json()
        assert r.status == 503 and "ingest_task_dead" in body["failure"], body
        metrics = await (await client.get("/metrics")).text()
        assert _metric(metrics, 'kvwire_index_failed{reason="ingest_task_dead"}') == 1.0
        assert member.supervisor.failed.is_set()
    finally:
        if client is not None:
            await client.close()
        await member.stop()


async def test_kvwire_index_exits_nonzero_when_snapshots_keep_failing(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=1)
    not_a_dir = tmp_path / "snapshots"
    not_a_dir.write_text("a file where the snapshot directory should be\n")
    fleet = await asyncio.to_thread(
        Fleet, kafka_bootstrap, topic, 1, sim={"seed": 71}, pub={"heartbeat_interval_s": 1.0}
    )
    log = tmp_path / "index.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_KAFKA_")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from kvwire.cli import app; app()",
                "index",
                "-b",
                kafka_bootstrap,
                "-t",
                topic,
                "--http",
                f"127.0.0.1:{port}",
                "--snapshot-dir",
                str(not_a_dir),
                "--snapshot-interval",
                "0.1",
                "--snapshot-records",
                "1",
                "--snapshot-failures",
                "2",
                "--snapshot-retry",
                "0.1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        try:
            await asyncio.to_thread(fleet.run, 30)
            fleet.start(pace_s=0.01)
            rc = await asyncio.to_thread(proc.wait, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            await asyncio.to_thread(fleet.close, 10)
    text = log.read_text(errors="replace")
    assert rc == 1, text[-3000:]
    assert "unhealthy, exiting" in text and "snapshots_failing" in text, text[-3000:]
