"""README figures, generated. Every number about kvwire's speed or size in README.md and
bench/README.md comes from ``bench/results/*.json`` through this module, never typed in by hand.

Each generated block sits between ``<!-- figures:NAME -->`` and ``<!-- /figures:NAME -->``.
``kvwire bench`` rewrites the blocks after a run; ``python -m bench.report`` does it from the
JSON on disk, ``--check`` only compares (tests/bench/test_report.py runs it, so a README figure
that disagrees with its JSON fails the suite).

The anchors' columns are their published figures, quoted (``../shared/reference/anchors.md``),
not measurements: they are constants here on purpose.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
READMES = (ROOT / "README.md", ROOT / "bench" / "README.md")

Results = dict[str, Any]  # step name -> its JSON

# summary key -> (target, "min" if the figure must reach it, "max" if it must stay under it, what)
TARGETS: dict[str, tuple[float, str, str]] = {
    "apply_core_blocks_per_s": (5_000_000, "min", "apply, pre-fetched record bytes → decode, fence, index"),
    "apply_blocks_per_s": (2_000_000, "min", "apply through the broker, one member"),
    "score_p99_us_8k_tokens": (100, "max", "score p99 µs, 8k tokens, 10M holder-blocks, 256 workers, top_k 16"),
    "score_p99_us_8k_tokens_all_workers": (250, "max", "same, every matched worker returned"),
    "score_p99_us_under_ingest": (
        250,
        "max",
        "same query from another thread while the member applies 1M blocks/s (median of 5 rounds)",
    ),
    "bytes_per_holder_block": (28, "max", "index bytes per holder-block at 10M"),
    "lag_p99_ms": (10, "max", "publish() → applied p99 ms"),
    "first_score_ms_after_ready": (50, "max", "first score after ready, ms"),
    "replay_blocks_per_s": (2_000_000, "min", "replay blocks/s"),
    "http_score_rps_c32": (10_000, "min", "HTTP scores/s, binary body, 32 clients"),
    "http_score_p99_ms_c32": (5, "max", "HTTP score p99 ms, 32 clients"),
    "http_score_p50_us_c1": (150, "max", "HTTP score p50 µs, one client"),
    "peers_score_p99_ratio_vs_dynamo_radix": (1.0, "max", "score p99, kvwire / Dynamo RadixTree, same run (peers)"),
    "peers_score_p50_ratio_vs_dynamo_radix": (1.0, "max", "score p50, kvwire / Dynamo RadixTree, same run (peers)"),
    "peers_apply_ratio_vs_dynamo_radix": (1.0, "min", "apply blocks/s, kvwire / Dynamo RadixTree, same run (peers)"),
    "clear_rank_ms_1m_blocks": (10, "max", "AllBlocksCleared of a rank holding 1M blocks, on-CPU ms (clear_rank)"),
    "soak_rss_growth_pct": (5, "max", "RSS growth after warm-up, 30 min of churn at 100k blocks/s (soak)"),
}


def load(results: Path = RESULTS) -> Results:
    out: Results = {}
    for p in sorted(results.glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except ValueError:
            continue
    return out


def _run_label(mode: str) -> str:
    """'full run', 'quick run'; a partial re-run says which steps are new."""
    return f"{mode} run" if mode in ("full", "quick", "smoke", "unknown") else mode


def fmt(v: Any, unit: str = "", digits: int = 3) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if abs(v) < 100 and not (isinstance(v, int) or float(v).is_integer()):
        return f"{v:.{digits}g}{unit}"
    return f"{round(v):,}{unit}"


def _get(d: Any, *path: str) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _largest(sizes: dict[str, Any]) -> tuple[str | None, dict[str, Any] | None]:
    if not sizes:
        return None, None
    label = max(sizes, key=lambda k: float(k.rstrip("MK")) * (1e6 if k.endswith("M") else 1e3))
    return label, sizes[label]


# Sources of the published figures: ../shared/reference/anchors.md quotes each project's own.
ANCHORS = "anchors.md"


def _peers(res: Results) -> tuple[str, list[tuple[str, str, str, str]]]:
    """The peers run's sentence and rows: Dynamo's trees measured here beside kvwire (bench/peers)."""
    pe = res.get("peers") or {}
    med = pe.get("median") or {}
    kv, rx, cr = med.get("kvwire") or {}, med.get("radix") or {}, med.get("crtc") or {}
    pp, la = pe.get("params") or {}, pe.get("load_avg") or {}
    if not kv:
        return "`python -m bench.peers` (Dynamo's trees beside kvwire's core): not measured yet.\n\n", []

    def score(f: dict) -> str:
        return f"{fmt(_get(f, 'score_cpu_us', 'p50'), ' µs')} / {fmt(_get(f, 'score_cpu_us', 'p99'), ' µs')}"

    def ratios(d: str) -> str:
        return " / ".join(
            fmt(pe.get(f"peers_{m}_ratio_vs_dynamo_{d}"), "x") for m in ("score_p99", "score_p50", "apply")
        )

    head = (
        f"`python -m bench.peers` (kvwire's core through Python beside `dynamo-kv-router` {pp.get('dynamo_kv_router')} "
        f"from the Rust package registry, on the same dumped workload: {fmt(pp.get('holder_blocks'))} holder-blocks, "
        f"{fmt(pp.get('workers'))} workers, {fmt(pp.get('query_tokens'))}-token queries; one process per index, "
        f"alternating, medians of {fmt(pp.get('rounds'))} rounds, on-CPU; every answer equal: "
        f"{'yes' if pe.get('answers_equal') else 'NO'}; load average {fmt((la.get('start') or [None])[0])} at start, "
        f"{fmt((la.get('end') or [None])[0])} at end):\n\n"
    )
    rows = [
        (
            "Peers run: apply, blocks/s on-CPU (kvwire: records' bytes through the applier, decoded, fenced and hashed in the core; "
            "Dynamo: `apply_event` of blocks its publisher already hashed)",
            fmt(kv.get("apply_blocks_per_s")),
            f"{fmt(rx.get('apply_blocks_per_s'))} / {fmt(cr.get('apply_blocks_per_s'))} "
            f"(with that hashing: {fmt(rx.get('apply_blocks_per_s_with_publisher_hashing'))} / "
            f"{fmt(cr.get('apply_blocks_per_s_with_publisher_hashing'))})",
            f"Dynamo CRTC bench: 13.26M block ops/s (dynamo#11372, via {ANCHORS})",
        ),
        (
            "Peers run: score 8k tokens, every matched worker, hashing included, p50 / p99 on-CPU",
            score(kv),
            f"{score(rx)}; {score(cr)}",
            f"Dynamo CRTC bench: lookup 2.38 µs / 10.12 µs (dynamo#11372, via {ANCHORS}); SGLang SMG: "
            f"292 ns / 7.6 µs, hashing excluded ({ANCHORS})",
        ),
        (
            "Peers run: bytes per holder-block, RSS growth (kvwire's own count)",
            f"{fmt(kv.get('rss_bytes_per_holder_block'), ' B')} ({fmt(kv.get('own_bytes_per_holder_block'), ' B')})",
            f"{fmt(rx.get('rss_bytes_per_holder_block'), ' B')} / {fmt(cr.get('rss_bytes_per_holder_block'), ' B')}",
            f"SGLang SMG: positional index 166.7 B/block, its radix tree ~6x smaller; AIBrix: ~64 B/entry, a claim "
            f"({ANCHORS})",
        ),
        (
            "Peers run: kvwire / Dynamo, median of per-round ratios, score p99 / score p50 / apply "
            "(score: lower is better for kvwire; apply: higher)",
            "—",
            f"RadixTree {ratios('radix')}; CRTC {ratios('crtc')}",
            "—",
        ),
    ]
    return head, rows


def _clear_row(res: Results) -> tuple[str, str, str]:
    """AllBlocksCleared of a big rank (bench/clear_rank.py): the clear's own apply, and the sweep after it."""
    cr = res.get("clear_rank") or {}
    rounds = cr.get("rounds") or [{}]
    worst = max((r.get("sweep_max_apply_ms") or 0 for r in rounds), default=None)
    applies = max((r.get("sweep_applies") or 0 for r in rounds), default=None)
    return (
        f"AllBlocksCleared of a rank holding {fmt(cr.get('cleared_rank_blocks'))} blocks, on-CPU ms (scaled to 1M); "
        "the later applies that purge its slots, and the slowest of them",
        f"{fmt(_get(res, 'summary', 'clear_rank_ms_1m_blocks'), ' ms')}; {fmt(applies)} applies, "
        f"≤ {fmt(worst, ' ms')} each",
        "not published",
    )


def _soak_row(res: Results) -> tuple[str, str, str]:
    """The soak run (bench/soak.py): memory growth under steady churn, beside Dynamo's reported leak."""
    so = res.get("soak") or {}
    p = so.get("params") or {}
    theirs = (
        "Dynamo ConcurrentRadixTreeCompressed: memory grows without bound under prefix churn, internal nodes "
        "never reclaimed (dynamo#10774, their report; not measured here)"
    )
    if not so:
        return (
            "Soak: RssAnon growth after warm-up under steady churn",
            "not measured yet (`python -m bench.soak`)",
            theirs,
        )
    dur = so.get("duration_s")
    span = "n/a" if dur is None else f"{dur / 60:.0f} min" if dur >= 120 else f"{dur:.0f} s"
    return (
        f"Soak: RssAnon growth after warm-up (index's own bytes), {span} of churn, {fmt(p.get('holder_blocks'))} "
        f"holder-blocks over {fmt(p.get('workers'))} workers, {fmt(so.get('achieved_stored_blocks_per_s'))} stored "
        f"blocks/s (offered {fmt(p.get('rate_blocks_per_s'))}), load average {fmt((_get(so, 'load_avg', 'end') or [None])[0])}",
        f"{fmt(so.get('soak_rss_growth_pct'), '%')} ({fmt(so.get('index_nbytes_growth_pct'), '%')})",
        theirs,
    )


def results_table(res: Results) -> str:
    """Ours beside Dynamo's trees measured here (bench/peers), and beside the figures others publish."""
    s = res.get("summary", {})
    g = s.get
    sc = res.get("score_latency") or {}
    label, row = _largest(sc.get("sizes", {}))
    over = f" over {label} holder-blocks" if label else ""

    def lat(mode: str, key: str) -> str:
        p50, p99 = _get(row, "8k", mode, "p50"), _get(row, "8k", mode, "p99")
        cpu99 = _get(row, "8k", "cpu_time", mode, "p99")
        return f"{fmt(p50, ' µs')} / {fmt(g(key) if key else p99, ' µs')} ({fmt(cpu99, ' µs')})"

    lg = res.get("lag") or {}
    rows = [
        (
            "Apply, blocks/s, pre-fetched records (decode + fence + index)",
            fmt(g("apply_core_blocks_per_s")),
            f"Dynamo Flash Indexer: >10M events+queries/s on 32 cores, 24 event threads ({ANCHORS})",
        ),
        (
            "Apply, blocks/s, one member through the broker (fetch + decode + fence + index)",
            fmt(g("apply_blocks_per_s")),
            "not published",
        ),
        (
            f"Score 8k tokens{over}, 256 workers, hashing included, top_k 16, p50 / p99 (on-CPU p99)",
            lat("top16", "score_p99_us_8k_tokens"),
            f"SGLang SMG: 292 ns / 7.6 µs, hashing excluded ({ANCHORS})",
        ),
        (
            f"Score 8k tokens{over}, every matched worker returned, p50 / p99 (on-CPU p99)",
            lat("all_workers", "score_p99_us_8k_tokens_all_workers"),
            f"Dynamo Flash Indexer: p99 < 10 µs ({ANCHORS})",
        ),
        (
            f"Score 8k tokens{over}, top_k 16 without hashing (keys given), p50 / p99 (on-CPU p99)",
            lat("without_hashing", "score_p99_us_8k_tokens_no_hashing"),
            "as above",
        ),
        (
            "Index bytes per holder-block",
            fmt(g("bytes_per_holder_block"), " B"),
            f"AIBrix: ~64 B/entry, a claim ({ANCHORS})",
        ),
        _clear_row(res),
        _soak_row(res),
        (
            "Event-to-index lag p99 (publish() to applied)",
            f"{fmt(g('lag_p99_ms'), ' ms')} at {fmt(lg.get('lag_reported_at_offered_blocks_per_s'))} blocks/s "
            + (
                f"offered (median of {len(lg['lag_rounds_at_reported'])} rounds)"
                if len(lg.get("lag_rounds_at_reported") or []) > 1
                else "offered"
            )
            + f"; {fmt(_get(lg, 'max_unsaturated', 'lag_ms', 'p99'), ' ms')} at "
            f"{fmt(_get(lg, 'max_unsaturated', 'offered_blocks_per_s'))}; "
            + (
                f"saturates at {fmt(lg['saturated_at_offered_blocks_per_s'])}"
                + (f" ({lg['saturated_by']})" if lg.get("saturated_by") else "")
                if lg.get("saturated_at_offered_blocks_per_s")
                else f"no saturation up to {fmt(lg.get('top_offered_blocks_per_s'))}"
            )
            + "".join(
                f"; {fmt(d['dropped'])} records dropped at {fmt(d['offered_blocks_per_s'])} (reported as gaps)"
                for d in lg.get("dropped_at") or []
            )
            + f" ({_get(lg, 'params', 'publisher_hosts')} publisher process, the broker and the member on 2 CPUs)"
            + "".join(
                f"; {h} publisher processes: {fmt(f.get('lag_p99_ms'), ' ms')} at "
                f"{fmt(f.get('lag_reported_at_offered_blocks_per_s'))}"
                + (
                    f", saturates at {fmt(f['saturated_at_offered_blocks_per_s'])}"
                    + (f" ({f['saturated_by']})" if f.get("saturated_by") else "")
                    if f.get("saturated_at_offered_blocks_per_s")
                    else ""
                )
                for h, f in sorted((lg.get("fleet") or {}).items())
            ),
            f"none with its source here ({ANCHORS}: event-to-index lag that nobody measures)",
        ),
        (
            "publish() on the engine thread, p99.9: Kafka up / Kafka down",
            f"{fmt(g('publish_p999_us_kafka_up'), ' µs')} / {fmt(g('publish_p999_us_kafka_down'), ' µs')}",
            "vLLM ZmqEventPublisher: blocking Queue.put (vllm#53859); that pattern measured here: "
            + fmt(g("publish_p999_us_blocking_queue"), " µs"),
        ),
        (
            "Decode speed vs vLLM msgpack, per CPU-second: Rust decoder (the consumer's path) / "
            "Rust to Python objects / fastavro (tail, dead-letter reasons)",
            f"{fmt(g('rust_decode_speedup_vs_msgpack'), 'x')} / {fmt(g('rust_decode_to_objects_speedup_vs_msgpack'), 'x')}"
            f" / {fmt(g('fastavro_decode_speedup_vs_msgpack'), 'x')}",
            "msgpack decoded by msgspec to vLLM-shaped structs, measured here = 1x",
        ),
        (
            "Decode speed vs LMCache JSON, per CPU-second: Rust decoder / fastavro",
            f"{fmt(g('rust_decode_speedup_vs_json'), 'x')} / {fmt(g('fastavro_decode_speedup_vs_json'), 'x')}",
            "JSON decoded by the json module to dicts, measured here = 1x",
        ),
        ("Wire bytes vs vLLM msgpack", fmt(g("codec_bytes_ratio_vs_msgpack"), "x"), "vLLM msgpack = 1x"),
        (
            "Replay, blocks/s / cold start, s per million blocks",
            f"{fmt(g('replay_blocks_per_s'))} / {fmt(g('cold_start_s_per_million_blocks'), ' s')}",
            f"none has a replayable log; sgl-kv-indexer restart: 17% blind routing, in memory ({ANCHORS})",
        ),
    ]
    run = _get(s, "notes", "run") or {}
    head = (
        f"`kvwire bench` ({_run_label(run.get('mode', 'unknown'))}, {fmt(run.get('seconds'), ' s')}, load average at the end "
        f"{', '.join(fmt(x) for x in run.get('load_avg_at_end', [])) or 'n/a'}); "
    )
    peers_head, peers_rows = _peers(res)
    out = [
        "| | kvwire (ours, measured here) | Dynamo RadixTree / ConcurrentRadixTreeCompressed (measured here, same "
        "workload, peers run) | others (theirs, published, other machines; source) |",
        "|---|---|---|---|",
    ]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in peers_rows]
    out += [f"| {a} | {b} | — | {c} |" for a, b, c in rows]
    return head + peers_head + "\n".join(out)


def targets_table(res: Results) -> str:
    s = res.get("summary", {})
    out = ["| summary key | what | target | measured | |", "|---|---|---|---|---|"]
    for key, (target, sense, what) in TARGETS.items():
        v = s.get(key)
        if v is None:
            verdict = "not measured" + (f": {s['notes'][key]}" if key in s.get("notes", {}) else "")
        else:
            ok = v >= target if sense == "min" else v <= target
            verdict = "met" if ok else "missed"
        bound = ("≥ " if sense == "min" else "≤ ") + fmt(target)
        out.append(f"| `{key}` | {what} | {bound} | {fmt(v)} | {verdict} |")
    return "\n".join(out)


def codec_paragraph(res: Results) -> str:
    c = res.get("codec") or {}
    packed = _get(c, "codecs", "kvwire_avro_packed") or {}
    arr = _get(c, "codecs", "avro_array_long") or {}
    bpr = c.get("blocks_per_record")
    ratio = c.get("packed_vs_array_decode_speedup")
    extra = ""
    if packed.get("bytes_per_block") and arr.get("bytes_per_block"):
        more = packed["bytes_per_block"] / arr["bytes_per_block"] - 1
        extra = f" — packed is {fmt(ratio, 'x')} faster to decode for {more:.0%} more bytes"
    return (
        f"Codec representation (`python -m bench.codec`, {fmt(bpr)} blocks per record): token ids and hashes "
        f"packed in Avro `bytes` decode with fastavro at {fmt(packed.get('decode_records_per_s'))} records/s "
        f"({fmt(packed.get('decode_blocks_per_s'))} blocks/s) and encode (`codec.encode`: the core's writer, "
        f"fastavro's rules) at {fmt(packed.get('encode_records_per_s'))} "
        f"records/s, {fmt(packed.get('bytes_per_block'))} B per block; the same contract with `array<long>` decodes "
        f"at {fmt(arr.get('decode_records_per_s'))} records/s and encodes (fastavro) at "
        f"{fmt(arr.get('encode_records_per_s'))} "
        f"records/s, {fmt(arr.get('bytes_per_block'))} B per block{extra}."
    )


def replay_sentence(res: Results) -> str:
    r = res.get("replay") or {}
    label, row = _largest({k: v for k, v in r.items() if re.fullmatch(r"\d+[MK]", k)})
    if not row:
        return "Cold start from a snapshot + tail against a full replay: not measured yet (`python -m bench.replay`)."
    return (
        f"On assignment a member loads the newest snapshot and replays only the tail: "
        f"{fmt(row.get('cold_start_s'), ' s')} for {label} holder-blocks, against {fmt(row.get('replay_s'), ' s')} "
        f"for a full replay; a snapshot costs {fmt(row.get('snapshot_bytes_per_holder_block'), ' B')} per holder-block "
        f"(`python -m bench.replay`)."
    )


def hybrid_block(res: Results) -> str:
    """Grouped scoring of a hybrid fleet beside the same fleet as plain workers (bench/hybrid.py)."""
    h = res.get("hybrid") or {}
    if "plain" not in h or "hybrid" not in h:
        return "Hybrid fleet beside a plain one: not measured yet (`python -m bench.hybrid`)."
    rows = [
        "| fleet | holder-blocks | apply blocks/s | score p50 µs (on-CPU) | score p99 µs (on-CPU) | workers matched per query |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("plain", "hybrid"):
        r = h[name]
        sc = r["score"]
        rows.append(
            f"| {name} | {fmt(r['holder_blocks'])} | {fmt(r['apply_blocks_per_s'])} | "
            f"{fmt(sc['wall_us']['p50'])} ({fmt(sc['cpu_us']['p50'])}) | "
            f"{fmt(sc['wall_us']['p99'])} ({fmt(sc['cpu_us']['p99'])}) | {fmt(r['matched_per_query'])} |"
        )
    ratio = h.get("hybrid_over_plain", {})
    return (
        f"{fmt(h.get('conversations'))} conversations of 8k tokens over 256 workers; the hybrid fleet adds a "
        f"{fmt(h.get('window_tokens'))}-token sliding-window group. 8k-token queries, top 16. Hybrid over "
        f"plain: score p50 ×{fmt(ratio.get('score_p50_cpu'))} on-CPU, p99 ×{fmt(ratio.get('score_p99_cpu'))}; "
        f"apply rate ×{fmt(ratio.get('apply_rate'))}.\n\n" + "\n".join(rows)
    )


def faults_table(res: Results) -> str:
    f = res.get("faults") or {}
    out = [
        "| fault | records in flight at the fault | acknowledged records lost | time to converge |",
        "|---|---|---|---|",
    ]
    for name in sorted(f):
        e = f[name]
        if not isinstance(e, dict) or "acked_records_lost" not in e:
            continue
        in_flight = e.get("records_in_flight_at_fault", e.get("records_in_flight_at_faults_max"))
        converge = [(k.removeprefix("converge_s_"), v) for k, v in sorted(e.items()) if k.startswith("converge_s_")]
        conv = "; ".join(f"{fmt(v, ' s')} {k.replace('_', ' ')}" for k, v in converge) or "n/a"
        out.append(f"| {name.replace('_', ' ')} | {fmt(in_flight)} | {fmt(e['acked_records_lost'])} | {conv} |")
    return "\n".join(out)


def kafka_side_block(res: Results) -> str:
    """aiokafka's fetch ceiling and what coalescing engine steps per record buys (bench/kafka_side.py)."""
    k = res.get("kafka_side") or {}
    grid = k.get("fetch_grid") or []
    if not grid:
        return "Kafka side: not measured yet (`python -m bench.kafka_side`)."
    out = [
        f"Fetch alone (`getmany`, no decode; {fmt(k.get('records'))} records of {fmt(k.get('blocks_per_record'))} "
        f"blocks, {fmt(k.get('partitions'))} partitions; median of {fmt(grid[0].get('reps'))} reads; "
        f"load average {fmt(k.get('load_avg_1m'))}):",
        "",
        "| max_records | fetch bytes | fetch_max_wait_ms | blocks/s | blocks per CPU-s | MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in grid:
        out.append(
            f"| {fmt(r.get('max_records'))} | {fmt((r.get('fetch_bytes') or 0) / 2**20, ' MiB')} "
            f"| {fmt(r.get('fetch_max_wait_ms'))} | {fmt(r.get('blocks_per_s'))} | {fmt(r.get('blocks_per_cpu_s'))} "
            f"| {fmt(r.get('mb_per_s'))} |"
        )
    out += ["", "Fetch + `Applier.apply_records` per poll, as the member does:", ""]
    out += ["| setting | blocks/s | blocks per CPU-s |", "|---|---|---|"]
    for label, r in (k.get("fetch_and_apply") or {}).items():
        out.append(f"| {label.replace('_', ' ')} | {fmt(r.get('blocks_per_s'))} | {fmt(r.get('blocks_per_cpu_s'))} |")
    core = k.get("core_only") or {}
    at_target = k.get("one_core_ceiling_at_core_target_blocks_per_s")
    verdict = "" if at_target is None else (": the fetch alone keeps one member under 2M" if at_target < 2e6 else "")
    out += [
        "",
        f"The core alone on the same bytes: {fmt(core.get('blocks_per_s'))} blocks/s "
        f"({fmt(core.get('blocks_per_cpu_s'))} per CPU-s); the fetch is {fmt(100 * (k.get('fetch_share_of_cpu') or 0), '%')} "
        f"of one core's work per block, so one core tops out at {fmt(k.get('one_core_ceiling_blocks_per_s'))} blocks/s, "
        f"and at {fmt(k.get('one_core_ceiling_at_core_target_blocks_per_s'))} blocks/s with the core at its "
        f"5M target{verdict}.",
        "",
        "Coalescing 8-block engine steps per record (publisher's producer settings), then applying:",
        "",
        "| steps/record | B/block | produce records/s | produce CPU µs/block | encode CPU µs/block "
        "| apply CPU µs/block | apply blocks/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, r in sorted((k.get("coalesce") or {}).items(), key=lambda kv: int(kv[0])):
        out.append(
            f"| {fmt(r.get('steps_per_record'))} | {fmt(r.get('value_bytes_per_block'))} "
            f"| {fmt(r.get('produce_records_per_s'))} | {fmt(r.get('produce_cpu_us_per_block'))} "
            f"| {fmt(r.get('encode_cpu_us_per_block'))} | {fmt(r.get('apply_cpu_us_per_block'))} "
            f"| {fmt(r.get('apply_blocks_per_s'))} |"
        )
    cod = k.get("codecs") or {}
    if cod.get("rows"):
        out += [
            "",
            f"Produce-batch codecs over bench.lag's records ({fmt(cod.get('records'))} records of "
            f"{fmt(cod.get('value_bytes_mean'))} B; aiokafka's builder and reader, no broker; ratio = value "
            "bytes / batch bytes; the publisher's default is none, `PublisherConfig.compression_type`):",
            "",
            "| records/batch | codec | ratio | build CPU µs/record | parse CPU µs/record |",
            "|---|---|---|---|---|",
        ]
        for r in cod["rows"]:
            out.append(
                f"| {fmt(r.get('records_per_batch'))} | {r.get('codec')} | {fmt(r.get('ratio'))} "
                f"| {fmt(r.get('build_cpu_us_per_record'))} | {fmt(r.get('parse_cpu_us_per_record'))} |"
            )
    return "\n".join(out)


BLOCKS: dict[str, Callable[[Results], str]] = {
    "results": results_table,
    "targets": targets_table,
    "codec": codec_paragraph,
    "replay": replay_sentence,
    "faults": faults_table,
    "hybrid": hybrid_block,
    "kafka_side": kafka_side_block,
}

# The body is whole lines (or nothing, in a README not yet rendered).
_BLOCK = re.compile(r"(<!-- figures:(?P<name>[a-z_]+) -->\n)(?P<body>(?:.*?\n)?)(<!-- /figures:(?P=name) -->)", re.S)


def render_file(text: str, res: Results) -> str:
    def one(m: re.Match[str]) -> str:
        make = BLOCKS.get(m["name"])
        if make is None:
            raise KeyError(f"unknown figures block {m['name']!r}")
        return m.group(1) + make(res) + "\n" + m.group(4)

    return _BLOCK.sub(one, text)


def stale(res: Results, paths: tuple[Path, ...] = READMES) -> list[str]:
    """The README blocks that differ from what the JSON says."""
    bad = []
    for p in paths:
        text = p.read_text()
        for m in _BLOCK.finditer(text):
            want = BLOCKS[m["name"]](res) + "\n"
            if m["body"] != want:
                bad.append(f"{p.relative_to(ROOT)}: figures:{m['name']}")
    return bad


def write(res: Results, paths: tuple[Path, ...] = READMES) -> list[Path]:
    changed = []
    for p in paths:
        text = p.read_text()
        new = render_file(text, res)
        if new != text:
            p.write_text(new)
            changed.append(p)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 when a README is stale")
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    res = load(a.results)
    if a.check:
        bad = stale(res)
        for b in bad:
            print(f"stale: {b} (run python -m bench.report)", file=sys.stderr)
        return 1 if bad else 0
    for p in write(res):
        print(f"updated {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
