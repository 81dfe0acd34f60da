"""Peers in the bench: kvwire's core beside Dynamo's ``RadixTree`` and
``ConcurrentRadixTreeCompressed`` (``dynamo-kv-router`` 1.6.1) on kvwire's own workload.

    python -m bench.peers [--quick] [--holder-blocks N] [--rounds R] [--queries N]

Method: the workload is dumped once (``dump.py``); each index replays it in its own process
(kvwire: ``kvwire_side.py``; Dynamo: the Rust harness ``src/main.rs``), the sides alternating
order round by round; apply and score are timed on the writing / querying thread's CPU clock
(CLOCK_THREAD_CPUTIME_ID; wall clock beside it); the score timing includes hashing the tokens
on both sides; every answer (per-worker matched blocks of every query) must equal kvwire's, or
the run fails. Ratios are kvwire / Dynamo per round, then the median over rounds.

Default size: 10M holder-blocks, 256 workers, 8k-token queries (``--quick``: 1M). Needs cargo
(the harness is built here, not in CI); without it the step fails with that line.
Writes bench/results/peers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..common import cpu_model, percentiles, write_result
from . import SUMMARY_KEYS, dump

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DYNAMO = "1.6.1"  # Cargo.toml pins dynamo-kv-router to this version
SIDES = ("kvwire", "radix", "crtc")  # radix: RadixTree; crtc: ConcurrentRadixTreeCompressed


class PeersError(RuntimeError):
    """The step cannot measure (no cargo, a failed build) or the sides disagree."""


def harness() -> Path:
    """Builds the Rust harness (its own Cargo.lock, outside rust/'s workspace) and returns it."""
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    if not Path(cargo).exists():
        raise PeersError("cargo not found: the peers step builds bench/peers (install Rust with rustup)")
    target = Path(os.environ.get("CARGO_TARGET_DIR") or HERE / "target")
    cmd = [cargo, "build", "--release", "--locked", "--manifest-path", str(HERE / "Cargo.toml")]
    p = subprocess.run(cmd, env=dict(os.environ, CARGO_TARGET_DIR=str(target)), capture_output=True, text=True)
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-12:]
        sys.stderr.write("\n".join(tail) + "\n")
        raise PeersError(f"cargo build of bench/peers failed (exit {p.returncode}): {tail[-1] if tail else ''}")
    return target / "release" / "kvwire-bench-peers"


def figures(raw: dict) -> dict:
    """One process's headline figures from its raw output (one percentile rule for both sides)."""
    hb = raw["holder_blocks"]
    out = {
        "apply_blocks_per_s": round(raw["blocks_applied"] / raw["apply_cpu_s"]),
        "apply_blocks_per_s_wall": round(raw["blocks_applied"] / raw["apply_wall_s"]),
        "score_cpu_us": {k: round(v, 2) for k, v in percentiles(raw["score_cpu_us"]).items()},
        "score_wall_us": {k: round(v, 2) for k, v in percentiles(raw["score_wall_us"]).items()},
        "rss_bytes_per_holder_block": round(raw["rss_anon_growth_bytes"] / hb, 1),
    }
    if "own_bytes_per_holder_block" in raw:
        out["own_bytes_per_holder_block"] = round(raw["own_bytes_per_holder_block"], 2)
    if raw.get("publisher_hashing_cpu_s"):  # Dynamo's publisher hashes tokens beside the engine
        cpu = raw["apply_cpu_s"] + raw["publisher_hashing_cpu_s"]
        out["apply_blocks_per_s_with_publisher_hashing"] = round(raw["blocks_applied"] / cpu)
    return out


def check_answers(want: list, got: list, side: str) -> None:
    if want == got:
        return
    i = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
    raise PeersError(
        f"ANSWERS DIFFER: {side} query {i}: kvwire {want[i][:8]}{'...' if len(want[i]) > 8 else ''} "
        f"!= {side} {got[i][:8]}{'...' if len(got[i]) > 8 else ''} (worker, matched blocks)"
    )


def ratios(kv: dict, dy: dict) -> dict:
    """kvwire / Dynamo: lower is better for kvwire on score, higher on apply."""
    return {
        "score_p99": round(kv["score_cpu_us"]["p99"] / dy["score_cpu_us"]["p99"], 3),
        "score_p50": round(kv["score_cpu_us"]["p50"] / dy["score_cpu_us"]["p50"], 3),
        "apply": round(kv["apply_blocks_per_s"] / dy["apply_blocks_per_s"], 3),
    }


def _median(rows: list[dict]) -> dict:
    """Median of each figure over rounds (nested dicts of numbers)."""
    out: dict = {}
    for k, v in rows[0].items():
        if isinstance(v, dict):
            out[k] = _median([r[k] for r in rows])
        else:
            m = statistics.median(r[k] for r in rows)
            out[k] = round(m, 3) if isinstance(m, float) else m
    return out


def run(holder_blocks: int, rounds: int, n_queries: int, workdir: Path) -> dict:
    exe = harness()
    t0 = time.monotonic()
    load_start = list(os.getloadavg())
    path = workdir / "peers.dump"
    h = dump.write(path, holder_blocks, n_queries)
    dump_s = round(time.monotonic() - t0, 1)
    print(f"dumped {h.holder_blocks:,} holder-blocks, {h.queries} queries in {dump_s} s", flush=True)
    cmds = {
        "kvwire": [sys.executable, "-m", "bench.peers.kvwire_side"],
        "radix": [str(exe), "radix"],
        "crtc": [str(exe), "crtc"],
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    want = None
    out_rounds = []
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        row: dict = {"order": list(order), "load_avg_1m": {}}
        for side in order:
            ans = workdir / f"{side}.answers"
            row["load_avg_1m"][side] = round(os.getloadavg()[0], 2)
            p = subprocess.run(
                [*cmds[side], str(path), str(ans)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800
            )
            if p.returncode != 0:
                sys.stderr.write(p.stderr[-3000:])
                raise PeersError(f"{side} run failed (exit {p.returncode}): {p.stderr.strip()[-300:]}")
            raw = json.loads(p.stdout.strip().splitlines()[-1])
            if raw["blocks_applied"] != h.blocks_stored:
                raise PeersError(f"{side} applied {raw['blocks_applied']:,} blocks of {h.blocks_stored:,}")
            got = dump.read_answers(ans, h.queries)
            if want is None:  # round 1 runs kvwire first: every later run must answer the same
                want = got
            else:
                check_answers(want, got, side)
            row[side] = figures(raw)
            if side == "radix":
                row[side]["tree_holder_blocks"] = raw["tree_holder_blocks"]
            print(f"round {r + 1} {side:>6}: {row[side]}", flush=True)
        row["ratios_vs"] = {d: ratios(row["kvwire"], row[d]) for d in ("radix", "crtc")}
        out_rounds.append(row)
    assert want is not None
    res: dict = {
        "what": "kvwire's core (through Python) beside Dynamo's radix trees, same workload, same machine",
        "params": {
            "holder_blocks": h.holder_blocks,
            "blocks_stored": h.blocks_stored,
            "workers": h.workers,
            "block_size": h.block_size,
            "blocks_per_event": h.blocks_per_event,
            "query_tokens": h.query_tokens,
            "queries": h.queries,
            "warmup_queries": h.warmup,
            "query_mix": "bench.score_latency.queries: 1/3 stored conversation, 1/3 system prompt + new text, 1/3 miss",
            "rounds": rounds,
            "dynamo_kv_router": DYNAMO,
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
        },
        "method": (
            "one process per index per round, order alternating; on-CPU clock of the applying / "
            "querying thread (CRTC: its writer thread); score = hashing + lookup, all matched workers; "
            "kvwire apply = Kafka records' bytes through Applier.apply_records (decoded, fenced, hashed in the core), Dynamo "
            "apply = apply_event of events carrying content hashes its publisher computed (that hashing "
            "reported apart); bytes = RssAnon growth over the build / holder-blocks; ratios = kvwire / "
            "Dynamo per round, median over rounds"
        ),
        "answers_equal": True,
        "queries_checked_per_run": h.queries,
        "matched_workers_per_query_mean": round(sum(len(a) for a in want) / len(want), 2),
        "dump_s": dump_s,
        "rounds": out_rounds,
        "load_avg": {"start": load_start, "end": list(os.getloadavg())},
        "seconds": round(time.monotonic() - t0, 1),
    }
    res.update(aggregate(out_rounds))
    return res


def aggregate(rounds: list[dict]) -> dict:
    """Each side's median figures and the summary keys: medians of the per-round ratios."""
    out: dict = {"median": {s: _median([r[s] for r in rounds]) for s in SIDES}}
    for k in SUMMARY_KEYS:
        m, d = k.removeprefix("peers_").split("_ratio_vs_dynamo_")
        out[k] = round(statistics.median(r["ratios_vs"][d][m] for r in rounds), 3)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M holder-blocks (default 10M)")
    ap.add_argument("--holder-blocks", type=int, default=None, help="holder-block target of the index")
    ap.add_argument("--rounds", type=int, default=9, help="rounds of alternating processes (at least 3)")
    ap.add_argument("--queries", type=int, default=None, help="8k-token queries per run (default 3000)")
    a = ap.parse_args(argv)
    if a.rounds < 3:
        ap.error("--rounds must be at least 3: the figures are medians of per-round ratios")
    hb = a.holder_blocks or (1_000_000 if a.quick else 10_000_000)
    n = a.queries or 3000
    try:
        with tempfile.TemporaryDirectory(prefix="kvwire-peers-") as t:
            res = run(hb, a.rounds, n, Path(t))
    except PeersError as e:
        print(f"peers: {e}", file=sys.stderr)
        return 1
    for k in SUMMARY_KEYS:
        print(f"{k}: {res[k]}")
    print("wrote", write_result("peers", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
