"""Run every benchmark against a real broker, plot, and write ``summary.json``.

Each benchmark runs in its own process (``python -m bench.<name>``): a 10M-block index is freed
when its step ends, one step crashing does not stop the others, and no step inherits another's
warm caches or threads. Results land in ``bench/results/`` (``KVWIRE_BENCH_RESULTS`` or
``--results`` to move them); a step counts only if it rewrote its JSON during this run.

    python -m bench [--quick | --smoke] [--only NAME ...]
    kvwire bench [--quick]

``--quick`` takes a few minutes on a 2-core machine; ``--smoke`` (the test suite's) uses tiny
sizes and checks only that every step runs and every summary key is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .codec import SUMMARY_KEYS as CODEC_KEYS
from .peers import SUMMARY_KEYS as PEERS_KEYS

SUMMARY_KEYS = (
    "apply_blocks_per_s",
    "apply_core_blocks_per_s",
    "score_p99_us_8k_tokens",
    "score_p99_us_8k_tokens_no_hashing",
    "score_p99_us_8k_tokens_all_workers",
    "score_p99_us_under_ingest",
    "first_score_ms_after_ready",
    "bytes_per_holder_block",
    "lag_p99_ms",
    "publish_p999_us_kafka_up",
    "publish_p999_us_kafka_down",
    "publish_p999_us_blocking_queue",
    *CODEC_KEYS,
    "replay_blocks_per_s",
    "cold_start_s_per_million_blocks",
    "http_score_rps_c32",
    "http_score_p99_ms_c32",
    "http_score_p50_us_c1",
    "http_score_rps_c32_json",
    *PEERS_KEYS,
    "clear_rank_ms_1m_blocks",
    "soak_rss_growth_pct",
    "notes",
)

# Steps that never talk to Kafka: running only these starts no broker.
BROKERLESS = ("peers", "clear_rank", "soak")

_IM_SMOKE = (
    "from bench.index_memory import run; from bench.common import write_result; "
    "write_result('index_memory', run([30000], score_at=30000))"
)


def steps(mode: str, bootstrap: str, peers_holder_blocks: int | None = None) -> list[tuple[str, list[str], int]]:
    """(name, python args, timeout s) per benchmark, in run order."""
    q = ["--quick"] if mode != "full" else []
    b = ["--bootstrap", bootstrap]
    tiny = mode == "smoke"
    out = [
        ("codec", ["-m", "bench.codec", "--quick"] if tiny else ["-m", "bench.codec", *q], 300),
        ("publish_cost", ["-m", "bench.publish_cost", *b, *(["--calls", "3000"] if tiny else q)], 600),
        ("index_memory", ["-c", _IM_SMOKE] if tiny else ["-m", "bench.index_memory", *q], 1800),
        ("apply_rate", ["-m", "bench.apply_rate", *b, *(["--blocks", "20000"] if tiny else q)], 900),
        (
            "score_latency",
            ["-m", "bench.score_latency", *(["--sizes", "30000", "--queries", "60"] if tiny else q)],
            1800,
        ),
        ("lag", ["-m", "bench.lag", *b, *(["--rates", "200", "400", "--seconds", "1"] if tiny else q)], 900),
    ]
    if not tiny:  # fetch grid, fetch + apply, coalescing: minutes even at --quick, so not in the smoke run
        out.append(("kafka_side", ["-m", "bench.kafka_side", *q], 1200))
    if not tiny:
        # Dynamo's trees beside kvwire's core (bench/peers): builds a Rust harness against Dynamo's
        # crate (minutes of CPU the first time), so neither the smoke run nor CI runs it.
        size = ["--holder-blocks", str(peers_holder_blocks)] if peers_holder_blocks else q
        out.append(("peers", ["-m", "bench.peers", *size], 3600))
    out.append(("clear_rank", ["-m", "bench.clear_rank", *(["--smoke"] if tiny else q)], 900))
    # 30 minutes of churn at full size (bench/soak.py), 60 s at --quick, a few seconds in the smoke run.
    soak_size = ["--smoke"] if tiny else q
    out.append(("soak", ["-m", "bench.soak", *soak_size], 2400 if mode == "full" else 600))
    if not tiny or shutil.which("wrk"):
        # wrk (apt-get install -y wrk) is its load generator; the smoke run skips the step without it.
        hs = ["--holder-blocks", "30000", "--seconds", "1", "--n-queries", "8", "--workers", "1"] if tiny else q
        out.append(("http_score", ["-m", "bench.http_score", *hs], 1800))
    if importlib.util.find_spec("bench.replay") is not None:
        # bench/replay.py has no size option below --quick's 1M; the smoke run drives one tiny size.
        smoke = (
            "import asyncio, sys, tempfile; from bench import replay as r; from bench.common import write_result\n"
            "with tempfile.TemporaryDirectory() as t: row = asyncio.run(r.run_size(sys.argv[1], 20000, t))\n"
            "write_result('replay', {'smoke_20k': row, 'replay_blocks_per_s': row['replay_blocks_per_s'], "
            "'cold_start_s_per_million_blocks': row['cold_start_s_per_million_blocks']})"
        )
        out.append(
            (
                "replay",
                ["-c", smoke, bootstrap] if tiny else ["-m", "bench.replay", *q, "--bootstrap-servers", bootstrap],
                1800,
            )
        )
    return out


def _load(results: Path, name: str, since: float):
    p = results / f"{name}.json"
    if not p.exists() or p.stat().st_mtime < since:
        return None
    return json.loads(p.read_text())


def _largest(rows: dict) -> tuple[str, dict] | tuple[None, None]:
    """The entry of a {size label: row} map with the most holder-blocks."""
    sized = [(k, v) for k, v in rows.items() if isinstance(v, dict) and "holder_blocks" in v]
    return max(sized, key=lambda kv: kv[1]["holder_blocks"]) if sized else (None, None)


def _find(d, *names):
    """First value under any of ``names`` anywhere in a nested result (replay's keys may move)."""
    if isinstance(d, dict):
        for n in names:
            if n in d and isinstance(d[n], (int, float)) and not isinstance(d[n], bool):
                return d[n]
        for v in d.values():
            r = _find(v, *names)
            if r is not None:
                return r
    return None


def summarize(res: dict, errors: dict) -> dict:
    s = {k: None for k in SUMMARY_KEYS}
    notes: dict[str, str] = {}

    def missing(keys, step):
        why = errors.get(step, f"{step} did not run")
        for k in keys:
            notes[k] = f"null: {why}"

    c = res.get("codec")
    ck = CODEC_KEYS
    if c:
        for k in ck:
            s[k] = c.get(k)
        notes["codec"] = (
            "decode per CPU-second, kvwire Avro over vLLM msgpack (msgspec, to structs) / LMCache JSON "
            "(to dicts), records of {} blocks: rust = the consumer's decoder (to Rust records), "
            "rust_to_objects = the same to EventBatch objects, fastavro = the reference decoder of tail "
            "and dead-letter reasons; bytes ratio < 1 = smaller".format(c.get("blocks_per_record"))
        )
    else:
        missing(ck, "codec")

    p = res.get("publish_cost")
    pk = {
        "publish_p999_us_kafka_up": "kvwire_kafka_up",
        "publish_p999_us_kafka_down": "kvwire_kafka_down",
        "publish_p999_us_blocking_queue": "vllm_blocking_queue_put",
    }
    if p:
        for k, run in pk.items():
            s[k] = p["runs"][run]["p99.9"]
        notes["publish"] = (
            "engine-thread cost of one publish() call; blocking_queue = vLLM's Queue.put pattern "
            "behind a {} us/batch sender; noise floor p99.9 {} us".format(
                p["params"]["consumer_us"], p["runs"]["noise_floor_deque_append"]["p99.9"]
            )
        )
    else:
        missing(pk, "publish_cost")

    m = res.get("index_memory")
    label, row = _largest(m or {})
    if row:
        s["bytes_per_holder_block"] = row["bytes_per_holder_block"]
        notes["bytes_per_holder_block"] = (
            f"at {row['holder_blocks']:,} holder-blocks over 256 workers (index_memory {label})"
        )
    else:
        missing(["bytes_per_holder_block"], "index_memory")

    a = res.get("apply_rate")
    if a:
        s["apply_blocks_per_s"] = a["apply_blocks_per_s"]
        s["apply_core_blocks_per_s"] = a.get("apply_core_blocks_per_s")
        notes["apply_blocks_per_s"] = (
            "one consumer process: AIOKafkaConsumer on a pre-filled topic -> Applier.apply_records "
            "(one core call per slice: decode, fence, index); {} blocks/record".format(a["params"]["blocks_per_record"])
        )
        notes["apply_core_blocks_per_s"] = "pre-fetched record bytes -> core apply_poll (fast decode, fence, index)"
    else:
        missing(["apply_blocks_per_s", "apply_core_blocks_per_s"], "apply_rate")

    sc = res.get("score_latency")
    label, row = _largest((sc or {}).get("sizes", {}))
    sk = (
        "score_p99_us_8k_tokens",
        "score_p99_us_8k_tokens_no_hashing",
        "score_p99_us_8k_tokens_all_workers",
        "score_p99_us_under_ingest",
    )
    if row and "8k" in row:
        r8 = row["8k"]
        top = r8.get("top16", r8["with_hashing"])
        s["score_p99_us_8k_tokens"] = top["p99"]
        s["score_p99_us_8k_tokens_no_hashing"] = r8["without_hashing"]["p99"]
        s["score_p99_us_8k_tokens_all_workers"] = r8.get("all_workers", {}).get("p99")
        ui = row.get("under_ingest")
        rounds = row.get("under_ingest_rounds")
        s["score_p99_us_under_ingest"] = (
            row["under_ingest_p99_median"] if rounds else ui["latency_us"]["p99"] if ui else None
        )
        notes["score"] = (
            f"8k-token prompts over {row['holder_blocks']:,} holder-blocks, 256 workers ({label}), hashing "
            f"included, top_k 16, arrays; p50 {top['p50']} us; on-CPU p99 "
            f"{r8.get('cpu_time', {}).get('top16', {}).get('p99')} us (wall p99 includes preemption)"
        )
        if ui:
            where = ui.get("scores_from", "the ingest loop")
            notes["score_p99_us_under_ingest"] = (
                f"same query, top 16, JSON, from {where}, while the ingest loop applies "
                f"{ui['applied_blocks_per_s']:,} blocks/s (offered {ui['offered_blocks_per_s']:,.0f}) in "
                f"{ui['slice_budget_us']} us slices; p50 {ui['latency_us']['p50']} us"
            )
            if "until_running_us" in ui:
                notes["score_p99_us_under_ingest"] += (
                    f"; p99 of its parts: until the thread runs again (wake-up, GIL) "
                    f"{ui['until_running_us']['p99']} us, the score call {ui['call_us']['p99']} us"
                )
            split = ui.get("cpu_split")
            if split:
                notes["score_p99_us_under_ingest"] += (
                    f"; ingest on CPU {','.join(map(str, split['ingest']))}, the query thread on "
                    f"{','.join(map(str, split['serving']))} (kvwire index --cpu-split)"
                )
            # The same query in the other cases of this run, each in one clause.
            for key, case in (
                ("under_ingest_restart", "that fleet restarting (every rank reset while holding its blocks)"),
                ("under_ingest_any_cpu", "both threads on any CPU (--no-cpu-split)"),
                ("under_ingest_same_loop", "the queries on the ingest loop itself"),
            ):
                other = row.get(key)
                if other:
                    notes["score_p99_us_under_ingest"] += (
                        f"; with {case} p99 {other['latency_us']['p99']} us "
                        f"({other['applied_blocks_per_s']:,} blocks/s applied)"
                    )
            # The anchor: the same paced queries with nothing ingesting (this machine's wake-up
            # of an idle CPU plus the score), measured in the same run.
            idle = row.get("under_ingest_none")
            if idle:
                notes["score_p99_us_under_ingest"] += (
                    f"; with no ingest at all, the same paced queries p99 {idle['latency_us']['p99']} us "
                    f"(until running {idle['until_running_us']['p99']} us)"
                )
            if rounds:
                none = row["under_ingest_none_rounds"]
                notes["score_p99_us_under_ingest"] += (
                    f"; the figure is the median of {len(rounds)} rounds' p99 (the first as above, each "
                    f"other on an index built afresh): {', '.join(str(r['p99']) for r in rounds)} us; "
                    f"with no ingest, the same rounds: {', '.join(str(r['p99']) for r in none)} us "
                    f"(median {row['under_ingest_none_p99_median']})"
                )
    else:
        missing(sk, "score_latency")
    fs = (sc or {}).get("first_score")
    if fs:
        s["first_score_ms_after_ready"] = fs["first_score_ms_after_ready"]
        notes["first_score_ms_after_ready"] = (
            f"fresh interpreter: first apply {fs['first_apply_ms']} ms, then first score {fs['first_score_ms']} ms"
        )
    else:
        missing(["first_score_ms_after_ready"], "score_latency")

    lg = res.get("lag")
    if lg and lg.get("lag_p99_ms") is not None:
        s["lag_p99_ms"] = lg["lag_p99_ms"]
        mu = lg["max_unsaturated"]
        at = lg.get("lag_reported_at_offered_blocks_per_s") or mu["offered_blocks_per_s"]
        sat = lg.get("saturated_at_offered_blocks_per_s")
        rounds = lg.get("lag_rounds_at_reported") or []
        notes["lag_p99_ms"] = (
            f"publish() -> applied, at {at:,} blocks/s offered (the first unsaturated level at >= 500k, "
            f"else the highest unsaturated)"
            + (
                f", the median of {len(rounds)} rounds' p99 there: " + ", ".join(f"{r['p99']}" for r in rounds) + " ms"
                if len(rounds) > 1
                else ""
            )
            + f"; p99 {mu['lag_ms']['p99']} ms at the highest unsaturated level "
            f"({mu['offered_blocks_per_s']:,} blocks/s); "
            + (
                f"saturated at {sat:,} blocks/s offered ({lg.get('saturated_at_target_blocks_per_s') or sat:,} asked), "
                f"by the {lg.get('saturated_by') or 'member'}"
                if sat
                else "no level saturated"
            )
            + "".join(
                f"; {d['dropped']:,} records dropped (a publisher's hand-off full, each reported as a gap) "
                f"at {d['offered_blocks_per_s']:,} blocks/s" + (f", round {d['round']}" if d["round"] else "")
                for d in lg.get("dropped_at") or []
            )
            + f"; {lg['params']['publisher_hosts']} publisher process"
            + "".join(
                f"; with {h} publisher processes: p99 {f.get('lag_p99_ms')} ms at "
                f"{f.get('lag_reported_at_offered_blocks_per_s') or 0:,} blocks/s"
                for h, f in sorted((lg.get("fleet") or {}).items())
            )
        )
    elif lg:
        notes["lag_p99_ms"] = "null: no offered load stayed below saturation"
    else:
        missing(["lag_p99_ms"], "lag")

    r = res.get("replay")
    rk = ("replay_blocks_per_s", "cold_start_s_per_million_blocks")
    if r:
        s["replay_blocks_per_s"] = _find(r, "replay_blocks_per_s", "blocks_per_s")
        s["cold_start_s_per_million_blocks"] = _find(r, "cold_start_s_per_million_blocks", "s_per_million_blocks")
        sizes = sorted(k for k, v in r.items() if isinstance(v, dict) and "holder_blocks" in v)
        notes["replay"] = (
            f"bench/replay.py headline (its largest size measured in this run: {', '.join(sizes)}; "
            "a --quick run measures 1M only and carries no older row)"
        )
        for k in rk:
            if s[k] is None:
                notes[k] = "null: bench/replay.py wrote no such figure"
    elif "replay" not in errors:
        for k in rk:
            notes[k] = "null: bench/replay.py is not in the tree yet (another engineer is writing it)"
    else:
        missing(rk, "replay")
    hs = res.get("http_score")
    hk = ("http_score_rps_c32", "http_score_p99_ms_c32", "http_score_p50_us_c1", "http_score_rps_c32_json")
    if hs:
        for k in hk:
            s[k] = hs.get(k)
        p = hs["params"]
        notes["http_score"] = (
            f"wrk (own process) against a member process with {p['holder_blocks']:,} holder-blocks, "
            f"{p['query_tokens']}-token queries, ingest at {p['ingest_rate_blocks_per_s']:,.0f} blocks/s; binary c32 "
            f"best with {hs.get('http_score_rps_c32_http_workers')} HTTP worker(s); load average at end "
            f"{hs.get('loadavg_end')} on {p['cpus']} CPUs (bench/results/http_score.json has each run's)"
        )
    else:
        missing(hk, "http_score")
    pe = res.get("peers")
    if pe:
        for k in PEERS_KEYS:
            s[k] = pe.get(k)
        pp, la = pe["params"], pe["load_avg"]
        notes["peers"] = (
            f"kvwire / Dynamo (dynamo-kv-router {pp['dynamo_kv_router']}; radix = RadixTree, crtc = "
            f"ConcurrentRadixTreeCompressed), {pp['holder_blocks']:,} holder-blocks, {pp['workers']} workers, "
            f"{pp['query_tokens']}-token queries, medians of {pp['rounds']} rounds of alternating processes, "
            f"on-CPU, hashing included, every answer equal; score lower is better for kvwire, apply higher; "
            f"load average {la['start'][0]:.2f} at start, {la['end'][0]:.2f} at end (bench/results/peers.json)"
        )
    else:
        missing(PEERS_KEYS, "peers")
    cr = res.get("clear_rank")
    if cr:
        s["clear_rank_ms_1m_blocks"] = cr.get("clear_rank_ms_1m_blocks")
        worst = max((r["sweep_max_apply_ms"] or 0 for r in cr["rounds"]), default=0)
        applies = max((r["sweep_applies"] for r in cr["rounds"]), default=0)
        notes["clear_rank_ms_1m_blocks"] = (
            f"on-CPU ms of the apply carrying AllBlocksCleared for a rank of {cr['cleared_rank_blocks']:,} blocks "
            f"(scaled to 1M) beside {cr['other_blocks']:,} on {cr['workers'] - 1} other workers, median of "
            f"{len(cr['rounds'])} rounds; its slots purged by the next {applies} applies, the slowest "
            f"{worst:.2f} ms; answers checked: {cr['answers_ok']}; load average {cr['load_avg'][0]:.2f} at end "
            f"(bench/results/clear_rank.json)"
        )
    else:
        missing(["clear_rank_ms_1m_blocks"], "clear_rank")
    so = res.get("soak")
    if so:
        s["soak_rss_growth_pct"] = so.get("soak_rss_growth_pct")
        sp, la = so["params"], so["load_avg"]
        if s["soak_rss_growth_pct"] is None:
            notes["soak_rss_growth_pct"] = f"null: {so.get('growth_note', 'bench/soak.py wrote no growth figure')}"
        else:
            notes["soak_rss_growth_pct"] = (
                f"RssAnon of one process, max over the last 10% of a {so['duration_s']:.0f} s run against the end "
                f"of warm-up ({so['warmup_end_s']:.0f} s): {sp['workers']} workers' LRU pools of "
                f"{sp['holder_blocks']:,} holder-blocks churned at {so['achieved_stored_blocks_per_s']:,} stored "
                f"blocks/s (offered {sp['rate_blocks_per_s']:,.0f}) through Applier.apply_records, "
                f"{so['achieved_score_qps']} scores/s; index nbytes growth {so['index_nbytes_growth_pct']}%; "
                f"load average {la['start'][0]:.2f} at start, {la['end'][0]:.2f} at end (bench/results/soak.json)"
            )
    else:
        missing(["soak_rss_growth_pct"], "soak")
    for step, err in errors.items():
        notes.setdefault(f"error_{step}", err)
    s["notes"] = notes
    return s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="small sizes, a few minutes")
    g.add_argument("--smoke", action="store_true", help="tiny sizes: checks the harness, not speed")
    ap.add_argument(
        "--only", nargs="*", default=None, help="run only these steps (others are read from disk if present)"
    )
    ap.add_argument("--results", default=None, help="results folder (default bench/results)")
    ap.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (default: kvwire's resolver)")
    ap.add_argument(
        "--peers-holder-blocks", type=int, default=None, help="size of the peers step (default 10M, --quick 1M)"
    )
    a = ap.parse_args(argv)
    if a.results:
        os.environ["KVWIRE_BENCH_RESULTS"] = str(Path(a.results).resolve())
    elif a.smoke and not os.environ.get("KVWIRE_BENCH_RESULTS"):  # tiny numbers must not replace real ones
        import tempfile

        os.environ["KVWIRE_BENCH_RESULTS"] = tempfile.mkdtemp(prefix="kvwire-bench-smoke-")
    from . import common

    RESULTS = Path(os.environ.get("KVWIRE_BENCH_RESULTS") or common.RESULTS)
    bootstrap = a.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap and a.only is not None and set(a.only) <= set(BROKERLESS):
        bootstrap = "none (no step of this run uses a broker)"
    if not bootstrap:
        from kvwire.kafka.broker import resolve_bootstrap

        bootstrap = resolve_bootstrap()
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    label = mode  # what the summary says of this run
    if a.only == []:  # nothing re-run: say so, the figures are each step's own last run
        label = "summary of each step's last run on disk (see each JSON's _machine.when)"
    elif a.only:  # some steps re-run: the others' figures are older
        label = f"{mode} sizes, re-run: {', '.join(a.only)}; the other steps' last run on disk"
    env = dict(os.environ, KVWIRE_BENCH_RESULTS=str(RESULTS), PYTHONUNBUFFERED="1")
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    res, errors, timings = {}, {}, {}
    t_all = time.monotonic()
    for name, args, timeout in steps(mode, bootstrap, a.peers_holder_blocks):
        if a.only is not None and name not in a.only:
            res[name] = _load(RESULTS, name, 0)
            continue
        print(f"== {name}: {' '.join(args)}", flush=True)
        since = time.time() - 1
        t0 = time.monotonic()
        try:
            p = subprocess.run(
                [sys.executable, *args],
                cwd=root,
                env=env,
                timeout=timeout,
                stdout=sys.stdout,
                stderr=subprocess.PIPE,
                text=True,
            )
            if p.returncode != 0:
                errors[name] = f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"
                sys.stderr.write(p.stderr[-4000:])
        except subprocess.TimeoutExpired:
            errors[name] = f"timed out after {timeout} s"
        timings[name] = round(time.monotonic() - t0, 1)
        res[name] = _load(RESULTS, name, since)
        if res[name] is None and name not in errors:
            errors[name] = "wrote no result"
        print(f"   {name}: {timings[name]} s{'  FAILED: ' + errors[name] if name in errors else ''}", flush=True)
    summary = summarize(res, errors)
    summary["notes"]["run"] = {
        "mode": label,
        "seconds": round(time.monotonic() - t_all, 1),
        "step_seconds": timings,
        "load_avg_at_end": list(os.getloadavg()),
    }
    try:
        from .plots import make_all

        pngs = make_all(RESULTS)
        summary["notes"]["plots"] = [p.name for p in pngs]
    except Exception as e:  # plots are a convenience; the numbers stand without them
        summary["notes"]["plots_error"] = f"{type(e).__name__}: {e}"
    path = RESULTS / "summary.json"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    from . import report

    figures = report.load(RESULTS)
    (RESULTS / "table.md").write_text(report.results_table(figures) + "\n")
    if RESULTS.resolve() == report.RESULTS.resolve():  # a temp results folder never touches the READMEs
        for p in report.write(figures):
            print(f"updated {p.relative_to(report.ROOT)}", file=sys.stderr)
        # docs/scale.md is computed from these results too: rewritten with them, never left stale.
        from . import scale

        print(f"updated {scale.write(RESULTS).relative_to(report.ROOT)}", file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "notes"}, indent=2))
    print("wrote", path)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
