"""HTTP score serving: requests/s and latency of ``POST /v1/score`` on a live member under ingest.

The member is its own process (``python -m bench.http_score serve``): bench.index_memory's
workload (256 workers, 8k-token conversations over 16 shared system prompts) built to 10M
holder-blocks (``--quick``: 1M), served by ``kvwire.consumer.http`` (``HttpWorkers``, the
code ``kvwire index --http-workers N`` runs), while its event loop applies records through
the ingest path (``Applier.apply_records``: the Rust core decodes, fences and applies, in
time-budgeted slices) at ``--ingest-rate`` blocks/s (stores of fresh conversation blocks and
removals of the oldest, 32 + 32 blocks per record, so the index keeps its size). The records
are encoded before the clock starts; Kafka's fetch is not in the loop (bench.lag measures the
broker path).

The load generator is wrk (``apt-get install -y wrk``), another process: 8k-token queries
(bench.score_latency's mix: a stored conversation, a system prompt plus new text, a miss) as
little-endian uint32 bodies (``application/octet-stream``) or as JSON, at 1 and 32 connections.

Summary keys: ``http_score_rps_c32`` (binary, the best worker count), ``http_score_p99_ms_c32``
(that run's p99), ``http_score_p50_us_c1`` (binary, one connection), ``http_score_rps_c32_json``.

    python -m bench.http_score [--quick] [--seconds S] [--workers 1 2] [--ingest-rate 100000]

Writes bench/results/http_score.json. The numbers depend on what else the machine runs: the
result records the load average before and after each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import write_result

TOKENS = 8192
BLOCKS_PER_RECORD = 32
N_INGEST_RANKS = 64
WINDOW_BLOCKS = 512  # each ingest rank holds about this many blocks: stores and removals balance


# ---------------------------------------------------------------- the member process


def _ingest_records(n: int, seed: int = 7) -> list[bytes]:
    """``n`` encoded records, round-robin over the ingest ranks: each stores the next 32
    blocks of its conversation and, once it holds WINDOW_BLOCKS, removes its oldest 32."""
    from kvwire.schemas import codec
    from kvwire.schemas.events import BlockRemoved, EventBatch, WorkerId, stored

    rng = np.random.default_rng(seed)
    ranks = [WorkerId(f"ingest-{i}", 0, 0, 1, "m") for i in range(N_INGEST_RANKS)]
    held: list[list[tuple[int, ...]]] = [[] for _ in ranks]
    last: list[int | None] = [None] * len(ranks)
    seq = [0] * len(ranks)
    out = []
    for i in range(n):
        r = i % len(ranks)
        hashes = tuple(int(h) for h in rng.integers(1, 2**63, BLOCKS_PER_RECORD))
        toks = rng.integers(0, 128_000, BLOCKS_PER_RECORD * 16, dtype=np.uint32)
        evs: list = [stored(hashes, toks.tolist(), 16, parent_block_hash=last[r], medium="GPU")]
        last[r] = hashes[-1]
        held[r].append(hashes)
        if len(held[r]) * BLOCKS_PER_RECORD > WINDOW_BLOCKS:
            evs.append(BlockRemoved(held[r].pop(0), medium="GPU"))
        out.append(codec.encode(EventBatch(ranks[r], 1, seq[r], 0, tuple(evs), reset=seq[r] == 0)))
        seq[r] += 1
    return out


class _Rec:
    __slots__ = ("key", "offset", "timestamp", "value")

    def __init__(self, offset: int, value: bytes) -> None:
        self.offset, self.key, self.value, self.timestamp = offset, None, value, 0


async def _ingest(applier, recs: list[_Rec], rate_blocks: float, stats: dict) -> None:
    """Apply ``recs`` in order at ``rate_blocks`` blocks/s (stores + removals named), on this
    loop, in the slices the member's ingest uses, until cancelled or out of records."""
    blocks_per_rec = 2 * BLOCKS_PER_RECORD  # once warm, every record stores 32 and removes 32
    t0 = time.perf_counter()
    done = 0
    stats["started"] = t0
    while done < len(recs):
        due = min(len(recs), int((time.perf_counter() - t0) * rate_blocks / blocks_per_rec))
        while done < due:
            batch = recs[done:due]
            i = 0
            while i < len(batch):
                i = applier.apply_records("bench", 0, batch, i)
                await asyncio.sleep(0)  # readers between slices, as in ingest
            done = due
            stats["records"] = done
        await asyncio.sleep(0.005)
    stats["elapsed_s"] = time.perf_counter() - t0
    stats["exhausted"] = True


def serve_main(a: argparse.Namespace) -> None:
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    from kvwire.consumer.apply import Applier
    from kvwire.consumer.cpus import CpuSplit
    from kvwire.consumer.http import HttpWorkers, make_app

    from .index_memory import Workload as MemWorkload
    from .index_memory import build

    t = time.perf_counter()
    wl = MemWorkload()
    ix, _, _ = build(a.holder_blocks, wl)
    applier = Applier(index=ix)
    build_s = time.perf_counter() - t
    t = time.perf_counter()
    n_recs = int(a.ingest_rate * a.ingest_seconds / (2 * BLOCKS_PER_RECORD)) + 1
    recs = [_Rec(i, v) for i, v in enumerate(_ingest_records(n_recs))] if a.ingest_rate > 0 else []
    gen_s = time.perf_counter() - t
    # The queries the load generator sends: written here, where the workload's prompts are.
    from .score_latency import queries

    qdir = Path(a.queries_dir)
    for i, q in enumerate(queries(wl, TOKENS, a.n_queries)):
        (qdir / f"q{i}.bin").write_bytes(np.ascontiguousarray(q, "<u4").tobytes())
        (qdir / f"q{i}.json").write_bytes(json.dumps({"token_ids": q.tolist()}).encode())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # As `kvwire index` serves: HTTP on threads, ingest alone on this loop (--http-on-ingest-loop: shared),
        # each on its CPUs (--no-cpu-split: anywhere).
        cpus = CpuSplit.here() if a.cpu_split else None
        if cpus is not None:
            cpus.install(loop)
        workers = HttpWorkers(
            lambda: make_app(applier, lambda: True, home=loop),
            "127.0.0.1",
            0,
            a.http_workers,
            on_caller_loop=a.http_on_ingest_loop,
            cpus=cpus,
        )
        port = await workers.start()
        if cpus is not None:
            cpus.pin_ingest()
        stats: dict = {}
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        print(
            json.dumps(
                {
                    "port": port,
                    "holder_blocks": len(ix),
                    "build_s": round(build_s, 1),
                    "ingest_records_encoded": len(recs),
                    "encode_s": round(gen_s, 1),
                }
            ),
            flush=True,
        )
        # The parent starts ingest when its first measured run starts (a line on stdin).
        await loop.run_in_executor(None, sys.stdin.readline)
        task = asyncio.ensure_future(_ingest(applier, recs, a.ingest_rate, stats)) if recs else None
        await stop.wait()
        if task is not None:
            task.cancel()
        elapsed = time.perf_counter() - stats.get("started", time.perf_counter())
        elapsed = stats.get("elapsed_s", elapsed)
        print(
            json.dumps(
                {
                    "ingest_records_applied": stats.get("records", 0),
                    "ingest_seconds": round(elapsed, 2),
                    "ingest_blocks_per_s": round(stats.get("records", 0) * 2 * BLOCKS_PER_RECORD / max(elapsed, 1e-9)),
                    "ingest_ran_out_of_records": bool(stats.get("exhausted")),
                    "holder_blocks_after": len(ix),
                }
            ),
            flush=True,
        )
        await workers.cleanup()

    asyncio.run(main())


# ---------------------------------------------------------------- the load generator

_LUA = r"""
local dir, kind, n = "%(dir)s", "%(kind)s", %(n)d
local reqs, i = {}, 0
for q = 0, n - 1 do
  local f = assert(io.open(dir .. "/q" .. q .. "." .. kind, "rb"))
  local body = f:read("*all"); f:close()
  local ct = kind == "bin" and "application/octet-stream" or "application/json"
  reqs[q + 1] = wrk.format("POST", "/v1/score", {["Host"] = "127.0.0.1", ["Content-Type"] = ct}, body)
end
request = function()
  i = i %% n + 1
  return reqs[i]
end
local bad = 0
response = function(status, headers, body)
  if status ~= 200 then bad = bad + 1 end
end
done = function(summary, latency, requests)
  io.write(string.format(
    "KVWIRE {\"requests\": %%d, \"errors_status\": %%d, \"errors_socket\": %%d, \"duration_us\": %%d, " ..
    "\"p50_us\": %%d, \"p90_us\": %%d, \"p99_us\": %%d, \"p999_us\": %%d, \"max_us\": %%d}\n",
    summary.requests, summary.errors.status, summary.errors.connect + summary.errors.read +
    summary.errors.write + summary.errors.timeout, summary.duration,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9), latency.max))
end
"""


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def wrk_run(
    wrk: str, port: int, qdir: str, kind: str, n: int, conns: int, seconds: float, member_pid: int | None = None
) -> dict:
    script = Path(qdir) / f"{kind}.lua"
    script.write_text(_LUA % {"dir": qdir, "kind": kind, "n": n})
    threads = min(conns, 2)
    cmd = [wrk, "-t", str(threads), "-c", str(conns), "-d", f"{seconds:g}s", "--timeout", "10s", "-s", str(script)]
    cmd.append(f"http://127.0.0.1:{port}")
    load0 = os.getloadavg()
    cpu0 = _cpu_s(member_pid) if member_pid else None
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    cpu = _cpu_s(member_pid) - cpu0 if member_pid and cpu0 is not None else None
    m = re.search(r"^KVWIRE (\{.*\})$", out.stdout, re.M)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stdout[-500:]} {out.stderr[-500:]}")
    r = json.loads(m.group(1))
    rps = r["requests"] / (r["duration_us"] / 1e6)
    return {
        "body": "binary" if kind == "bin" else "json",
        "connections": conns,
        "wrk_threads": threads,
        "requests": r["requests"],
        "requests_per_s": round(rps),
        "p50_us": r["p50_us"],
        "p90_us": r["p90_us"],
        "p99_ms": round(r["p99_us"] / 1000, 3),
        "p999_ms": round(r["p999_us"] / 1000, 3),
        "max_ms": round(r["max_us"] / 1000, 3),
        # Load-independent: the member's CPU (HTTP and the ingest beside it) per request served.
        "member_cpu_us_per_request": round(cpu * 1e6 / r["requests"], 1) if cpu and r["requests"] else None,
        "member_cpu_cores_busy": round(cpu / (r["duration_us"] / 1e6), 2) if cpu else None,
        "non_200": r["errors_status"],
        "socket_errors": r["errors_socket"],
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join(cmd),
    }


def run_member(a: argparse.Namespace, http_workers: int, qdir: str, wrk: str) -> dict:
    """One member process with ``http_workers`` loops; the runs against it, in order."""
    cmd = [
        sys.executable,
        "-m",
        "bench.http_score",
        "serve",
        "--holder-blocks",
        str(a.holder_blocks),
        "--http-workers",
        str(http_workers),
        "--ingest-rate",
        str(a.ingest_rate),
        "--ingest-seconds",
        str(a.seconds * 4 + 10),
        "--queries-dir",
        qdir,
        "--n-queries",
        str(a.n_queries),
        *(["--http-on-ingest-loop"] if a.http_on_ingest_loop else []),
        *(["--switch-interval", str(a.switch_interval)] if a.switch_interval else []),
        *([] if a.cpu_split else ["--no-cpu-split"]),
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"member exited ({proc.wait()}) before listening")
        member = json.loads(line)
        print(
            f"  member: {member['holder_blocks']:,} holder-blocks (built in {member['build_s']} s), "
            f"{http_workers} HTTP worker(s), port {member['port']}",
            flush=True,
        )
        port = member["port"]
        runs = []
        # Warm-up, unmeasured: connections, caches, the first requests' allocations.
        wrk_run(wrk, port, qdir, "bin", a.n_queries, 4, 1)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        time.sleep(0.5)  # ingest under way before the clock starts
        plan = [("bin", 1), ("bin", 32), ("json", 32)] if http_workers == a.workers[0] else [("bin", 32)]
        for kind, conns in plan:
            r = wrk_run(wrk, port, qdir, kind, a.n_queries, conns, a.seconds, proc.pid)
            print(
                f"  {r['body']:6s} c{conns:<3d} {r['requests_per_s']:>7,} req/s  p50 {r['p50_us']:>6,} us  "
                f"p99 {r['p99_ms']:>7.2f} ms  member CPU {r['member_cpu_us_per_request']} us/req  "
                f"non-200 {r['non_200']}  load {r['loadavg_before'][0]}",
                flush=True,
            )
            runs.append(r)
        proc.send_signal(signal.SIGTERM)
        tail, _ = proc.communicate(timeout=120)
        ingest = json.loads(tail.strip().splitlines()[-1]) if tail.strip() else {}
        return {"http_workers": http_workers, "member": member, "ingest": ingest, "runs": runs}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _git_head() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except OSError:
        return None


def _core_built() -> str | None:
    """When the Rust extension the member loads was built (a tree shared by several people
    may rebuild it between runs)."""
    from kvwire import _core

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(Path(_core.__file__).stat().st_mtime))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        sp = argparse.ArgumentParser()
        sp.add_argument("--holder-blocks", type=int, required=True)
        sp.add_argument("--http-workers", type=int, default=1)
        sp.add_argument("--ingest-rate", type=float, default=100_000)
        sp.add_argument("--ingest-seconds", type=float, default=60)
        sp.add_argument("--queries-dir", required=True)
        sp.add_argument("--n-queries", type=int, default=64)
        sp.add_argument("--http-on-ingest-loop", action="store_true")
        sp.add_argument("--switch-interval", type=float, default=0.0)
        sp.add_argument("--no-cpu-split", dest="cpu_split", action="store_false")
        serve_main(sp.parse_args(argv[1:]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M holder-blocks, 5 s runs")
    ap.add_argument("--holder-blocks", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=None, help="per wrk run (default 15, --quick 5)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="HTTP worker counts to measure")
    ap.add_argument("--ingest-rate", type=float, default=100_000, help="blocks/s applied during the runs")
    ap.add_argument("--n-queries", type=int, default=64)
    ap.add_argument(
        "--http-on-ingest-loop",
        action="store_true",
        help="serve the first HTTP worker on ingest's loop (kvwire index serves from threads only)",
    )
    ap.add_argument(
        "--switch-interval", type=float, default=0.0, help="the member's sys.setswitchinterval (0: Python's 5 ms)"
    )
    ap.add_argument(
        "--no-cpu-split",
        dest="cpu_split",
        action="store_false",
        help="let the member's threads run on any CPU (kvwire index --no-cpu-split)",
    )
    a = ap.parse_args(argv)
    a.holder_blocks = a.holder_blocks or (1_000_000 if a.quick else 10_000_000)
    a.seconds = a.seconds or (5.0 if a.quick else 15.0)
    wrk = shutil.which("wrk")
    if wrk is None:
        sys.exit("bench.http_score needs wrk: apt-get install -y wrk")
    res: dict = {
        "params": {
            "holder_blocks": a.holder_blocks,
            "query_tokens": TOKENS,
            "queries": a.n_queries,
            "seconds_per_run": a.seconds,
            "ingest_rate_blocks_per_s": a.ingest_rate,
            "blocks_per_ingest_record": f"{BLOCKS_PER_RECORD} stored + {BLOCKS_PER_RECORD} removed",
            "http_workers": a.workers,
            "http_on_ingest_loop": a.http_on_ingest_loop,
            "switch_interval_s": a.switch_interval or sys.getswitchinterval(),
            "cpus": os.cpu_count(),
            "cpu_split": a.cpu_split,
            "command": " ".join(["python -m bench.http_score", *argv]),
            "git_head": _git_head(),
            "core_built": _core_built(),
        },
        "members": [],
    }
    with tempfile.TemporaryDirectory(prefix="kvwire-http-score-") as qdir:
        for w in a.workers:
            print(f"HTTP workers: {w}", flush=True)
            res["members"].append(run_member(a, w, qdir, wrk))
    first = res["members"][0]["runs"]
    c32 = [
        (m["http_workers"], r)
        for m in res["members"]
        for r in m["runs"]
        if r["body"] == "binary" and r["connections"] == 32
    ]
    best_w, best = max(c32, key=lambda wr: wr[1]["requests_per_s"])
    res["http_score_rps_c32"] = best["requests_per_s"]
    res["http_score_p99_ms_c32"] = best["p99_ms"]
    res["http_score_rps_c32_http_workers"] = best_w
    res["http_score_p50_us_c1"] = next(r["p50_us"] for r in first if r["connections"] == 1)
    res["http_score_rps_c32_json"] = next(r["requests_per_s"] for r in first if r["body"] == "json")
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print("wrote", write_result("http_score", res))


if __name__ == "__main__":
    main()
