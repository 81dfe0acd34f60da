"""Fault 2: an index member (`kvwire index` subprocess, snapshots in a directory) is SIGKILLed
mid-stream and restarted. The restart loads each partition's newest snapshot and replays only the
log after it; once the workload is over it serves the oracle's index over HTTP (/v1/digest,
/v1/workers, /v1/score)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from oracle_feed import (
    Fleet,
    build_expected,
    committed_offsets,
    end_offsets,
    free_port,
    read_log,
    record_result,
    score_requests,
    sim_blocks,
    wait_until,
)

from kvwire.consumer.snapshot import decode_snapshot

pytestmark = pytest.mark.integration


class IndexProcess:
    def __init__(self, bootstrap: str, topic: str, group: str, snapdir: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-c",
            "from kvwire.cli import app; app()",
            "index",
            "-b",
            bootstrap,
            "-t",
            topic,
            "--group",
            group,
            "--http",
            f"127.0.0.1:{self.port}",
            "--snapshot-dir",
            str(snapdir),
            "--snapshot-interval",
            "1",
            "--heartbeat-timeout",
            "600",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_KAFKA_")}
        self._out = open(log, "ab")  # noqa: SIM115 - outlives this call: the child writes to it until stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).resolve().parents[2]
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)
        self._out.close()

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()

    def log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])
        except OSError:
            return ""


async def _get(s: aiohttp.ClientSession, url: str):
    async with s.get(url) as r:
        if r.headers.get("content-type", "").startswith("application/json"):
            return r.status, await r.json()
        return r.status, await r.text()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def _snapshot_offsets(snapdir: Path, topic: str) -> dict[int, int]:
    out = {}
    for f in (snapdir / topic).glob("*.snap"):
        body = decode_snapshot(f.read_bytes())
        out[body.partition] = body.next_offset
    return out


async def test_consumer_sigkill_restart_resumes_from_snapshot(kafka_bootstrap, new_topic, tmp_path):
    topic = new_topic(partitions=4)
    group = f"g-{topic}"
    snapdir = tmp_path / "snapshots"
    fleet = await asyncio.to_thread(
        Fleet, kafka_bootstrap, topic, 4, sim={"seed": 21, "workers": 8}, pub={"heartbeat_interval_s": 1.0}
    )
    procs: list[IndexProcess] = []
    try:
        await asyncio.to_thread(fleet.run, 200)
        first = IndexProcess(kafka_bootstrap, topic, group, snapdir, tmp_path / "index-1.log")
        procs.append(first)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:

            async def ready(p: IndexProcess) -> bool:
                assert p.alive(), p.log_tail()
                return (await _get(s, f"{p.url}/healthz"))[0] == 200

            await wait_until(lambda: ready(first), 90, "first member ready")
            fleet.start(pace_s=0.003)

            async def snapshotted() -> bool:
                # A partition is snapshotted once it has records (an idle one has nothing to save).
                busy = {p for p, e in (await end_offsets(kafka_bootstrap, topic)).items() if e > 0}
                return fleet.acked_count() >= 700 and busy and busy <= set(_snapshot_offsets(snapdir, topic))

            await wait_until(snapshotted, 90, "periodic snapshots of every partition under traffic", every=0.5)
            # Let a snapshot be some records old, so the restart must replay a real tail.
            await asyncio.sleep(0.5)
            ends = await end_offsets(kafka_bootstrap, topic)
            committed = await committed_offsets(kafka_bootstrap, topic, group)
            snaps = _snapshot_offsets(snapdir, topic)
            first.kill()
            in_flight = sum(ends[p] - committed.get(p, 0) for p in ends)
            tail_at_kill = sum(ends[p] - snaps.get(p, 0) for p in ends)
            await asyncio.sleep(1.0)  # the fleet keeps publishing while no member runs

            t_restart = time.monotonic()
            second = IndexProcess(kafka_bootstrap, topic, group, snapdir, tmp_path / "index-2.log")
            procs.append(second)
            await wait_until(lambda: ready(second), 120, "restarted member ready")
            ready_s = time.monotonic() - t_restart
            await asyncio.sleep(1.0)  # live traffic through the restarted member
            stats = await asyncio.to_thread(fleet.close, 60)
            assert sum(x.dropped + x.lost + x.failed for x in stats) == 0, stats

            records = await read_log(kafka_bootstrap, topic)
            exp = build_expected(records, fleet.acks, fleet.epochs)
            assert exp.acked_lost == 0 and exp.duplicates == 0
            assert exp.blocks_per_worker() == sim_blocks(fleet.sim)
            want_digest = exp.digest()

            async def converged() -> bool:
                status, body = await _get(s, f"{second.url}/v1/digest")
                return status == 200 and body["digest"] == want_digest

            await wait_until(converged, 120, "restarted member's digest equal to the oracle's")
            converge_s = time.monotonic() - t_restart

            status, body = await _get(s, f"{second.url}/v1/workers")
            assert status == 200
            got = {(w["instance_id"], w["dp_rank"]): w["blocks"] for w in body["workers"] if w["blocks"]}
            assert got == exp.blocks_per_worker()
            assert all(w["trusted"] for w in body["workers"]), body
            for toks in score_requests(fleet.sim, 30):
                async with s.post(f"{second.url}/v1/score", json={"token_ids": toks}) as r:
                    assert r.status == 200
                    ans = (await r.json())["scores"]
                assert [(x["instance_id"], x["dp_rank"], x["matched_tokens"], x["score"]) for x in ans] == exp.score(
                    toks
                )
            _, metrics = await _get(s, f"{second.url}/metrics")
            replayed = int(_metric(metrics, "kvwire_records_applied_total"))
            # It resumed from the snapshots: it applied the tail, not the whole log again.
            assert replayed < len(records), (replayed, len(records))
        second.stop()
        assert second.proc.returncode == 0, second.log_tail()
        record_result(
            "consumer_sigkill_restart",
            records_in_flight_at_fault=in_flight,
            records_after_snapshot_at_fault=tail_at_kill,
            acked_records=exp.acked_records,
            acked_records_lost=exp.acked_lost,
            records_in_log=len(records),
            records_applied_after_restart=replayed,
            restart_ready_s=ready_s,
            converge_s_after_restart=converge_s,
        )
    finally:
        fleet.close(5)
        for p in procs:
            if p.alive():
                p.stop()
