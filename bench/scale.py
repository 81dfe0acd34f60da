"""docs/scale.md, generated: kvwire at 1k and 10k workers, computed from the per-unit costs the
other benchmarks measured on this machine (``bench/results/*.json``) and from the assumptions in
``ASSUMPTIONS``, the one place a figure that is not measured may come from.

    python -m bench.scale              # rewrite docs/scale.md from the results on disk
    python -m bench.scale --check      # exit 1 when docs/scale.md is not what this generates
    python -m bench.scale --measure    # also measure scatter here (< 1 min): bench/results/scale.json

``--measure`` runs 1 to 4 index members (one process each) over one workload split by worker,
member 0 scattering to the others as ``kvwire index --peer`` does (``consumer.http.make_app``), and
times sequential binary ``POST /v1/score`` calls to member 0 with each member's CPU per query. The
doc uses it when present (the scatter's per-peer cost and a check of the tail method) and says what
it lacks when not. tests/bench/test_scale.py fails when docs/scale.md differs from what this
generates, so the doc cannot be edited by hand.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .report import RESULTS, ROOT, _get, fmt, load

DOC = ROOT / "docs" / "scale.md"
SIZES = (1_000, 10_000)


@dataclass(frozen=True)
class Assumption:
    value: float
    what: str
    why: str


# Every figure the doc does not take from a results file. Change one and the doc follows.
ASSUMPTIONS: dict[str, Assumption] = {
    "gpu_hbm_gb": Assumption(80, "GPU memory per worker, GB", "one 80 GB GPU (H100 / A100 80GB) per worker, TP 1"),
    "gpu_memory_utilization": Assumption(0.9, "share of it vLLM may use", "vLLM's default `gpu_memory_utilization`"),
    "weights_gb": Assumption(16, "model weights, GB", "Llama-3.1-8B in bf16 (8.0B parameters × 2 B)"),
    "layers": Assumption(32, "layers", "Llama-3.1-8B"),
    "kv_heads": Assumption(8, "KV heads (GQA)", "Llama-3.1-8B"),
    "head_dim": Assumption(128, "head dimension", "Llama-3.1-8B"),
    "kv_dtype_bytes": Assumption(2, "bytes per KV element", "bf16 KV cache"),
    "block_size": Assumption(16, "tokens per block", "vLLM's default, and the benchmarks' workload"),
    "requests_per_worker_s": Assumption(1.0, "requests per worker per second", "a busy 8B worker on 8k prompts"),
    "prompt_tokens": Assumption(8192, "prompt tokens", "the benchmarks' 8k-token queries"),
    "prefix_hit": Assumption(0.5, "share of prompt tokens already cached", "half of each prompt reused"),
    "output_tokens": Assumption(512, "output tokens per request", "decode fills blocks the engine stores too"),
    "blocks_per_record": Assumption(8, "blocks per record", "one engine step per record (kafka_side's 1-step shape)"),
    "memory_budget_gib": Assumption(16, "index memory budget per member, GiB", "a member beside a router"),
    "apply_utilisation": Assumption(
        0.5, "largest share of measured apply rate a member may use", "room for scores and catch-up"
    ),
    "http_utilisation": Assumption(0.5, "largest share of measured HTTP capacity a member may use", "room for bursts"),
    "replication_factor": Assumption(3, "topic replication factor", "kvwire's default, min(3, brokers)"),
}

# Kafka's partition limits are theirs, quoted, not measured here.
KAFKA_LIMITS = {
    "replicas_per_broker": 4_000,
    "partitions_per_cluster": 200_000,
}
KAFKA_SOURCES = (
    "[KIP-578](https://cwiki.apache.org/confluence/spaces/KAFKA/pages/148641509/KIP-578+Add+configuration+to+limit+number+of+partitions) "
    '(Apache Kafka wiki): "the current generic recommendation to have no more than 4000 partitions per broker and '
    'no more than 200000 partitions per cluster is not enforced by Kafka" (counted here against replicas on a '
    "broker, the cautious reading); and Instaclustr's [KRaft series, part 3](https://www.instaclustr.com/blog/"
    "apache-kafka-kraft-abandons-the-zookeeper-part-3-maximum-partitions-and-conclusions/) (Kafka 3.2.1 in KRaft "
    "mode on one large instance, RF 1), whose partition creation first hit a limit at around 30,000 partitions "
    "(a memory-map error)"
)


def assume(name: str) -> float:
    return ASSUMPTIONS[name].value


# ---------------------------------------------------------------- per-unit costs, from results


@dataclass(frozen=True)
class Cost:
    value: float | None
    source: str  # file → key, or why it is missing


def _http_run(res: dict[str, Any], connections: int) -> dict[str, Any]:
    """http_score's binary run at ``connections`` with one HTTP worker: at 1, sequential requests (the
    latency a scatter waits on); at 32, the member saturated (its CPU per request under load)."""
    for member in _get(res, "http_score", "members") or []:
        for run in member.get("runs", []) if member.get("http_workers") == 1 else []:
            if run.get("body") == "binary" and run.get("connections") == connections:
                return dict(run)
    return {}


def costs(res: dict[str, Any]) -> dict[str, Cost]:
    c32 = _http_run(res, 32)
    sc = res.get("scale") or {}

    def get(file: str, *path: str) -> Cost:
        return Cost(_get(res, file, *path), f"`{file}.json` → `{'.'.join(path)}`")

    out = {
        "bytes_rss": get("peers", "median", "kvwire", "rss_bytes_per_holder_block"),
        "bytes_own": get("index_memory", "10M", "bytes_per_holder_block"),
        "apply_member": get("apply_rate", "apply_blocks_per_s"),
        "http_rps": get("http_score", "http_score_rps_c32"),
        "peer_cpu_us": Cost(
            c32.get("member_cpu_us_per_request"),
            "`http_score.json` → binary run at 32 connections, `member_cpu_us_per_request`",
        ),
        "fetch_blocks": get("kafka_side", "fetch_best", "blocks_per_s"),
        "fetch_mb": get("kafka_side", "fetch_best", "mb_per_s"),
        "store_bytes": get("kafka_side", "coalesce", "1", "value_bytes_per_block"),
        "cold_start": get("replay", "cold_start_s_per_million_blocks"),
        "replay_rate": get("replay", "replay_blocks_per_s"),
        "lag_saturation": get("lag", "saturated_at_offered_blocks_per_s"),
        "lag_top": get("lag", "top_offered_blocks_per_s"),
        "remove_bytes": get("scale", "removal_value_bytes_per_block"),
        "ask_cpu_per_peer_us": get("scale", "fit", "ask_cpu_us_per_peer"),
    }
    if not sc:
        for k in ("remove_bytes", "ask_cpu_per_peer_us"):
            out[k] = Cost(None, "not measured: `bench/results/scale.json` absent (`python -m bench.scale --measure`)")
    return out


def latency_points(run: dict[str, Any]) -> list[tuple[float, float]]:
    """(quantile, µs) of one run; its max stands for quantile 1 − 1/requests."""
    pts = [(0.5, run.get("p50_us")), (0.9, run.get("p90_us"))]
    pts += [(0.99, _ms(run.get("p99_ms"))), (0.999, _ms(run.get("p999_ms")))]
    n = run.get("requests") or 0
    if n > 1000:
        pts.append((1 - 1 / n, _ms(run.get("max_ms"))))
    return [(q, float(v)) for q, v in pts if v is not None]


def _ms(v: Any) -> float | None:
    return None if v is None else float(v) * 1000


def quantile(points: list[tuple[float, float]], q: float) -> float | None:
    """Latency at quantile q, linear in log(1 − q) between measured points (tails are roughly
    exponential there); None beyond the last point: the sample says nothing that far out."""
    if not points or q < points[0][0] or q > points[-1][0]:
        return None
    x = -math.log10(1 - q)
    for (q0, v0), (q1, v1) in itertools.pairwise(points):
        if q0 <= q <= q1:
            x0, x1 = -math.log10(1 - q0), -math.log10(1 - q1)
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0) if x1 > x0 else v1
    return points[-1][1]


def p99_of_max(points: list[tuple[float, float]], n: int) -> float | None:
    """p99 of the slowest of n independent answers: F⁻¹(0.99^(1/n))."""
    return quantile(points, 0.99 ** (1 / max(n, 1)))


def scatter_p99(points: list[tuple[float, float]], peers: int, per_peer_us: float) -> float | None:
    """p99 of a scattered score: the local part (p50), then the slowest peer, plus the asking loop's
    own work for each peer; with no peers, the member's own p99."""
    if not peers:
        return quantile(points, 0.99)
    slowest = p99_of_max(points, peers)
    return None if slowest is None else (quantile(points, 0.5) or 0.0) + slowest + per_peer_us * peers


# ---------------------------------------------------------------- the model


def worker_blocks() -> dict[str, float]:
    kv_bytes_token = 2 * assume("layers") * assume("kv_heads") * assume("head_dim") * assume("kv_dtype_bytes")
    kv_gb = assume("gpu_hbm_gb") * assume("gpu_memory_utilization") - assume("weights_gb")
    tokens = kv_gb * 1e9 / kv_bytes_token
    new_tokens_s = assume("requests_per_worker_s") * (
        assume("prompt_tokens") * (1 - assume("prefix_hit")) + assume("output_tokens")
    )
    stored_s = new_tokens_s / assume("block_size")
    return {
        "kv_bytes_token": kv_bytes_token,
        "kv_gb": kv_gb,
        "kv_tokens": tokens,
        "blocks": math.floor(tokens / assume("block_size")),
        "stored_s": stored_s,
        # a full cache evicts a block for every one it stores
        "churn_s": 2 * stored_s,
    }


def _ceil(x: float | None) -> int | None:
    return None if x is None else max(1, math.ceil(x - 1e-9))


def _div(x: float | None, y: float | None) -> float | None:
    return None if x is None or y in (None, 0) else x / y


def fleet(workers: int, c: dict[str, Cost], peer_latency: list[tuple[float, float]]) -> dict[str, Any]:
    wb = worker_blocks()
    v = {k: x.value for k, x in c.items()}
    holder = workers * wb["blocks"]
    churn = workers * wb["churn_s"]
    index_bytes = None if v["bytes_rss"] is None else holder * v["bytes_rss"]
    m_mem = _ceil(_div(index_bytes, assume("memory_budget_gib") * 2**30))
    m_apply = _ceil(_div(churn, None if v["apply_member"] is None else v["apply_member"] * assume("apply_utilisation")))
    members = min(workers, max(m_mem or 1, m_apply or 1))
    f: dict[str, Any] = {
        "workers": workers,
        "holder_blocks": holder,
        "churn": churn,
        "queries": workers * assume("requests_per_worker_s"),
        "index_bytes": index_bytes,
        "m_mem": m_mem,
        "m_apply": m_apply,
        "members": members,
        "member_bytes": _div(index_bytes, members),
        "member_apply_share": _div(churn / members, v["apply_member"]),
        "full_apply_share": _div(churn, v["apply_member"]),
        "member_holder": holder / members,
        "cold_start_s": None if v["cold_start"] is None else holder / members / 1e6 * v["cold_start"],
        "replay_s": _div(holder / members, v["replay_rate"]),
    }
    f.update(scatter(members, v, peer_latency))
    f["groups"] = _ceil(_div(f["queries"], f["group_qps"]))
    f["processes"] = None if f["groups"] is None else f["groups"] * members
    f.update(broker(workers, wb, f["groups"], members, v))
    return f


def scatter(members: int, v: dict[str, Any], pts: list[tuple[float, float]]) -> dict[str, Any]:
    """One query at a member of a group of ``members``: its local score, then every other member's
    over HTTP at once; latency = local + slowest peer + the asking member's per-peer work, which its
    one event loop does in series."""
    peers = members - 1
    per_peer_cpu = v["ask_cpu_per_peer_us"] or 0.0
    p99 = scatter_p99(pts, peers, per_peer_cpu)
    cpu = v["peer_cpu_us"]
    group_cpu = None if cpu is None else cpu + peers * (cpu + per_peer_cpu)
    # every member answers every query its group gets; asking rotates, so each carries 1/members of it
    member_cpu = _div(group_cpu, members)
    group_qps = None if member_cpu is None else assume("http_utilisation") * 1e6 / member_cpu
    return {
        "peers": peers,
        "peer_cpu_us": cpu,
        "tail_quantile": 0.99 ** (1 / max(peers, 1)),
        "scatter_p99_us": p99,
        "group_cpu_us": group_cpu,
        "group_qps": group_qps,
    }


def broker(workers: int, wb: dict[str, float], groups: int | None, members: int, v: dict[str, Any]) -> dict[str, Any]:
    rf = assume("replication_factor")
    replicas = workers * rf
    brokers = max(int(rf), math.ceil(replicas / KAFKA_LIMITS["replicas_per_broker"]))
    stored = workers * wb["stored_s"]
    remove_b = v["remove_bytes"] if v["remove_bytes"] is not None else v["store_bytes"]
    produce = None if v["store_bytes"] is None else stored * v["store_bytes"] + stored * remove_b
    records = workers * wb["churn_s"] / assume("blocks_per_record")
    g = groups or 1
    return {
        "partitions": workers,
        "replicas": replicas,
        "brokers": brokers,
        "produce_bytes": produce,
        "records": records,
        "broker_in": _div(None if produce is None else produce * rf, brokers),
        "broker_out": _div(None if produce is None else produce * (g + rf - 1), brokers),
        "broker_fetch_records": records * g / brokers,
        "broker_out_vs_measured": _div(
            None if produce is None else produce * (g + rf - 1) / brokers,
            None if v["fetch_mb"] is None else v["fetch_mb"] * 1e6,
        ),
        "member_fetch_blocks": workers * wb["churn_s"] / members,
        "member_fetch_share": _div(workers * wb["churn_s"] / members, v["fetch_blocks"]),
    }


def hashed_spread(workers: int, partitions: int) -> tuple[int, float, int]:
    """Workers on the busiest partition, its ratio to the mean, and the empty partitions, when
    kvwire's default rule (murmur2(key) % partitions, producer/partitioner.py) places keys
    ``worker-<i>/0``."""
    from kvwire.producer.partitioner import default_partition

    counts = [0] * partitions
    for i in range(workers):
        counts[default_partition(f"worker-{i}/0".encode(), partitions)] += 1
    return max(counts), max(counts) / (workers / partitions), counts.count(0)


# ---------------------------------------------------------------- the document


def _b(v: float | None) -> str:
    if v is None:
        return "n/a"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if v >= size:
            return f"{fmt(v / size)} {unit}"
    return f"{fmt(v)} B"


def _times(v: float | None) -> str:
    return "n/a" if v is None else f"{fmt(v)}×"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:.0f}%"


def _us(v: float | None, missing: str = "n/a") -> str:
    if v is None:
        return missing
    return f"{fmt(v / 1000)} ms" if v >= 1000 else f"{fmt(v)} µs"


def _unit(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{fmt(v)} {unit}"


Row = tuple[str, Callable[[dict[str, Any]], str], str]  # figure, its value for one fleet, how it is computed


def _rows(c: dict[str, Cost]) -> list[Row]:
    s = {k: x.source for k, x in c.items()}
    wb = "blocks a worker holds (assumptions)"
    return [
        ("holder-blocks in the index", lambda f: fmt(f["holder_blocks"]), f"workers × {wb}"),
        ("churn, blocks/s (stored + removed)", lambda f: fmt(f["churn"]), "workers × churn per worker (assumptions)"),
        ("scores/s (one per request)", lambda f: fmt(f["queries"]), "workers × requests per worker per second"),
        (
            "index memory, whole fleet",
            lambda f: _b(f["index_bytes"]),
            f"holder-blocks × RSS bytes per holder-block ({s['bytes_rss']})",
        ),
        ("members per group to fit memory", lambda f: fmt(f["m_mem"]), "⌈index memory / memory budget per member⌉"),
        (
            "members per group to keep up with apply",
            lambda f: fmt(f["m_apply"]),
            f"⌈churn / (apply blocks/s of one member × apply utilisation)⌉; apply: {s['apply_member']}",
        ),
        (
            "**members per group**",
            lambda f: f"**{fmt(f['members'])}**",
            "the larger of the two, at most one per partition",
        ),
        ("memory per member", lambda f: _b(f["member_bytes"]), "index memory / members"),
        (
            "apply per member, share of its measured rate",
            lambda f: _pct(f["member_apply_share"]),
            "churn / members / apply blocks/s of one member",
        ),
        (
            "one full index (each router its own group): apply share",
            lambda f: _pct(f["full_apply_share"]),
            "churn / apply blocks/s of one member; over 100%: that mode cannot keep up",
        ),
        (
            "cold start of a member from its snapshot",
            lambda f: f"{fmt(f['cold_start_s'])} s",
            f"holder-blocks per member × {s['cold_start']}",
        ),
        (
            "rebuild of a member from the log alone",
            lambda f: f"{fmt(f['replay_s'])} s",
            f"holder-blocks per member / {s['replay_rate']}",
        ),
        ("peers a score scatters to", lambda f: fmt(f["peers"]), "members − 1"),
        (
            "scatter p99, one query",
            lambda f: _us(f["scatter_p99_us"], "n/a (past the measured tail)"),
            "local p50 + p99 of the slowest of N peers + N × the asking member's CPU per peer (method below)",
        ),
        (
            "CPU per query, whole group",
            lambda f: _us(f["group_cpu_us"]),
            f"members × {s['peer_cpu_us']} + peers × {s['ask_cpu_per_peer_us']}",
        ),
        (
            "scores/s one group serves",
            lambda f: fmt(f["group_qps"]),
            "HTTP utilisation × 1 s / (CPU per query of the group / members)",
        ),
        (
            "**groups (replicas) for the score rate**",
            lambda f: f"**{fmt(f['groups'])}**",
            "⌈scores/s / scores/s one group serves⌉",
        ),
        ("member processes in all", lambda f: fmt(f["processes"]), "groups × members per group"),
    ]


def _broker_rows(c: dict[str, Cost]) -> list[Row]:
    s = {k: x.source for k, x in c.items()}
    rm = (
        s["remove_bytes"]
        if c["remove_bytes"].value is not None
        else "a removal taken as large as a store (not measured)"
    )
    return [
        ("partitions (one per worker)", lambda f: fmt(f["partitions"]), "kvwire's rule, below"),
        ("partition replicas", lambda f: fmt(f["replicas"]), "partitions × replication factor"),
        (
            f"brokers for ≤ {fmt(KAFKA_LIMITS['replicas_per_broker'])} replicas each",
            lambda f: fmt(f["brokers"]),
            f"⌈replicas / {fmt(KAFKA_LIMITS['replicas_per_broker'])}⌉, at least the replication factor (Kafka's guidance, theirs)",
        ),
        ("records/s produced", lambda f: fmt(f["records"]), "churn / blocks per record"),
        (
            "bytes/s produced",
            lambda f: _b(f["produce_bytes"]) + "/s",
            f"stored blocks/s × {s['store_bytes']} + removed blocks/s × {rm}",
        ),
        (
            "per broker: bytes/s in (leader + follower)",
            lambda f: _b(f["broker_in"]) + "/s",
            "bytes/s produced × replication factor / brokers",
        ),
        (
            "per broker: bytes/s out (groups' fetch + replication)",
            lambda f: _b(f["broker_out"]) + "/s",
            "bytes/s produced × (groups + replication factor − 1) / brokers",
        ),
        (
            "per broker: bytes/s out over the fetch measured here",
            lambda f: _times(f["broker_out_vs_measured"]),
            f"bytes/s out / {s['fetch_mb'].replace('blocks_per_s', 'mb_per_s')}",
        ),
        (
            "per broker: records/s fetched by the groups",
            lambda f: fmt(f["broker_fetch_records"]),
            "records/s × groups / brokers",
        ),
        ("per member: blocks/s fetched", lambda f: fmt(f["member_fetch_blocks"]), "churn / members per group"),
        (
            "per member: share of one consumer's measured fetch",
            lambda f: _pct(f["member_fetch_share"]),
            f"blocks/s fetched / {s['fetch_blocks']}",
        ),
    ]


def _table(rows: list[Row], figs: list[dict[str, Any]]) -> list[str]:
    head = "| figure (computed) | " + " | ".join(f"{fmt(f['workers'])} workers" for f in figs) + " | computed from |"
    out = [head, "|" + "---|" * (len(figs) + 2)]
    out += [f"| {name} | " + " | ".join(get(f) for f in figs) + f" | {src} |" for name, get, src in rows]
    return out


def _machines(res: dict[str, Any]) -> list[str]:
    names = ("index_memory", "apply_rate", "http_score", "kafka_side", "peers", "replay", "lag", "scale")
    out = ["| results file | machine | measured (`_machine.when`) |", "|---|---|---|"]
    for n in names:
        m = _get(res, n, "_machine")
        if m:
            out.append(
                f"| `bench/results/{n}.json` | {m.get('cpus')} CPUs, Python {m.get('python')} | {m.get('when')} |"
            )
        else:
            out.append(f"| `bench/results/{n}.json` | — | not present |")
    return out


def _assumption_table() -> list[str]:
    out = ["| assumption | value | why |", "|---|---|---|"]
    out += [f"| {x.what} | {fmt(x.value)} | {x.why} |" for x in ASSUMPTIONS.values()]
    return out


def _worker_lines() -> list[str]:
    wb = worker_blocks()
    return [
        f"From these, per worker (computed): KV bytes per token = 2 × layers × KV heads × head dimension × "
        f"bytes = {fmt(wb['kv_bytes_token'])} B; KV memory = {fmt(assume('gpu_hbm_gb'))} GB × "
        f"{fmt(assume('gpu_memory_utilization'))} − {fmt(assume('weights_gb'))} GB = {fmt(wb['kv_gb'])} GB; "
        f"{fmt(wb['kv_tokens'])} tokens, **{fmt(wb['blocks'])} blocks held** once its cache is full. New tokens per "
        f"second = requests × (prompt × (1 − prefix hit) + output) = {fmt(wb['stored_s'] * assume('block_size'))}, so "
        f"{fmt(wb['stored_s'])} blocks stored per second and as many evicted: **churn {fmt(wb['churn_s'])} blocks/s "
        "per worker**.",
    ]


def _scatter_lines(c: dict[str, Cost], figs: list[dict[str, Any]], pts: list[tuple[float, float]]) -> list[str]:
    ladder = ", ".join(f"q {q:.5g}: {_us(v)}" for q, v in pts)
    tails = "; ".join(f"N = {fmt(f['peers'])}: quantile {f['tail_quantile']:.5f}" for f in figs)
    out = [
        "**Tail of the fan-out (method).** A scattered score waits for its slowest peer. With N peers answering "
        "independently, the p99 of the slowest is the per-peer latency at quantile 0.99^(1/N) "
        f"({tails}). The per-peer distribution is `http_score.json`'s one-connection binary run against one member "
        f"holding 10M holder-blocks under ingest ({ladder}; its max counts as quantile 1 − 1/requests), "
        "interpolated linearly in log(1 − q); past its last point the doc says n/a rather than guess. Peers at "
        "these sizes hold more or fewer holder-blocks than that member and share no machine with each other, so "
        "the figure is the method applied to what was measured, not a measurement at that size.",
    ]
    if c["ask_cpu_per_peer_us"].value is None:
        out.append(
            "The asking member's own work per peer (sending, parsing and merging each answer) is not measured: "
            f"{c['ask_cpu_per_peer_us'].source}; the scatter figures leave it out and are a floor."
        )
    return out


def _measured_lines(res: dict[str, Any]) -> list[str]:
    sc = res.get("scale")
    if not sc:
        return [
            "Not measured: `bench/results/scale.json` is absent. `python -m bench.scale --measure` (under a minute) "
            "runs 1–4 members of one group on this machine and adds the asking member's per-peer cost."
        ]
    p = sc.get("params") or {}
    out = [
        f"`python -m bench.scale --measure` (`bench/results/scale.json`): {fmt(p.get('holder_blocks'))} holder-blocks "
        f"of bench.index_memory's workload ({fmt(p.get('workers'))} workers) split by worker over M members, one "
        f"process each, on this {fmt(_get(sc, '_machine', 'cpus'))}-CPU machine (load average "
        f"{fmt(p.get('loadavg_before'))} before, {fmt(p.get('loadavg_after'))} after); member 0 has the others as "
        f"peers; {fmt(p.get('queries'))} sequential 8k-token binary scores to member 0 per M (top_k "
        f"{fmt(p.get('top_k'))}). CPU = each member process's user + system time over the queries. Predicted p99 = "
        "the method above on this run's own M = 1 latencies, plus the fitted per-peer CPU of the asking member.",
        "",
        "| members | score p50 | score p99 (measured) | score p99 (predicted) | predicted / measured | asking member CPU per query | each peer's CPU per query |",
        "|---|---|---|---|---|---|---|",
    ]
    base = next((r for r in sc.get("runs", []) if r.get("members") == 1), None)
    pts = latency_points(base) if base else []
    per_peer = _get(sc, "fit", "ask_cpu_us_per_peer") or 0.0
    for r in sc.get("runs", []):
        n = r["members"] - 1
        pred = scatter_p99(pts, n, per_peer)
        out.append(
            f"| {r['members']} | {_us(r['p50_us'])} | {_us(r['p99_ms'] * 1000)} | {_us(pred)} | "
            f"{_times(_div(pred, r['p99_ms'] * 1000))} | "
            f"{_us(r['ask_cpu_us'])} | {_us(r.get('peer_cpu_us')) if n else '—'} |"
        )
    fit = sc.get("fit") or {}
    out += [
        "",
        f"Least-squares fit over M = 1..{max(r['members'] for r in sc['runs'])}: each extra peer adds "
        f"{_us(fit.get('ask_cpu_us_per_peer'))} of the asking member's CPU (p50 latency: "
        f"{_us(fit.get('latency_us_per_peer'))} per member, the peers' own answers included); one removal of {fmt(p.get('blocks_per_record'))} blocks encodes to "
        f"{fmt(sc.get('removal_value_bytes_per_block'))} B per block (codec.encode, value bytes). The box has "
        f"{fmt(_get(sc, '_machine', 'cpus'))} CPUs: from 3 members on, peers queue for a core, which a real group "
        "(one host each) would not.",
    ]
    return out


def _cluster_fit(figs: list[dict[str, Any]]) -> str:
    over = [f for f in figs if f["partitions"] > KAFKA_LIMITS["partitions_per_cluster"]]
    if not over:
        return "every size stays under the per-cluster figure"
    return "over the per-cluster figure: " + ", ".join(f"{fmt(f['workers'])} workers" for f in over)


def _default_partitions() -> int:
    from kvwire.producer.config import PublisherConfig

    return PublisherConfig().partitions


def _reading(figs: list[dict[str, Any]]) -> list[str]:
    """What the table says, from the figures: which limit sets the group size, and what a scatter costs."""
    big = figs[-1]
    binding = "apply" if (big["m_apply"] or 0) >= (big["m_mem"] or 0) else "memory"
    other = "memory" if binding == "apply" else "apply"
    ask = None if big["group_cpu_us"] is None else big["group_cpu_us"] - big["members"] * (big["peer_cpu_us"] or 0)
    text = (
        f"What it says: at {fmt(big['workers'])} workers {binding}, not {other}, sets the group size. The score "
        "rate sets the number of groups: a scattered score costs every member of its group, so one group serves "
        "about what one member serves, whatever its size, and more members per group buy apply capacity and "
        "shorter cold starts, never score capacity."
    )
    if ask:
        share = _pct(_div(ask, big["group_cpu_us"]))
        text += (
            f" Of the group's {_us(big['group_cpu_us'])} of CPU per query there, {_us(ask)} ({share}) is the asking "
            f"member's own work for its {fmt(big['peers'])} peers (sending, parsing and merging their answers in "
            "Python), not scoring."
        )
    return [text]


def _partition_lines(figs: list[dict[str, Any]]) -> list[str]:
    dflt = _default_partitions()
    out = [
        "**Partitions.** A record's key is the worker, `<instance_id>/<dp_rank>` (`WorkerId.kafka_key`, "
        "docs/DESIGN.md), so all TP ranks of a worker share a partition. The partition is Kafka's default "
        "`murmur2(key) % partitions` (`producer/partitioner.py`), or the one `PublisherConfig.partition` names "
        f"(e.g. the worker's ordinal); a topic kvwire creates has {dflt} partitions (`PublisherConfig.partitions`) "
        "unless told otherwise. *One partition per worker* needs that explicit partition: hashing W keys into "
        "W partitions leaves some empty and some doubled. A group can use at most one member per partition, and "
        "hashing spreads workers unevenly, so the busiest member carries more than the mean (computed with "
        "kvwire's partitioner over keys `worker-<i>/0`):",
        "",
        "| workers | partitions (hashed) | workers on the busiest partition | busiest / mean | empty partitions |",
        "|---|---|---|---|---|",
    ]
    for f in figs:
        for parts in sorted({dflt, f["workers"]} | ({f["members"]} if f["members"] > dflt else set())):
            top, ratio, empty = hashed_spread(f["workers"], parts)
            out.append(f"| {fmt(f['workers'])} | {fmt(parts)} | {fmt(top)} | {ratio:.2f} | {fmt(empty)} |")
    brokers = "; ".join(
        f"{fmt(f['partitions'])} partitions at replication factor {fmt(assume('replication_factor'))} need "
        f"{fmt(f['brokers'])} brokers"
        for f in figs
    )
    out += [
        "",
        f"With the default {dflt} partitions a group has at most {dflt} members; with one partition per worker "
        "(explicit) Kafka's assignor gives members equal shares of workers. Kafka's own limits (theirs, not "
        f"measured here): {KAFKA_SOURCES}. By that guidance ({fmt(KAFKA_LIMITS['replicas_per_broker'])} replicas "
        f"per broker, {fmt(KAFKA_LIMITS['partitions_per_cluster'])} partitions per cluster): {brokers}; "
        f"{_cluster_fit(figs)}.",
    ]
    return out


def render(res: dict[str, Any]) -> str:
    c = costs(res)
    pts = latency_points(_http_run(res, 1))
    figs = [fleet(w, c, pts) for w in SIZES]
    lag, lag_top = c["lag_saturation"], c["lag_top"]
    lines = [
        "# kvwire at 1,000 and 10,000 workers",
        "",
        "<!-- Generated by `python -m bench.scale` from bench/results/*.json; tests/bench/test_scale.py fails when this",
        "file differs from what it generates. Edit bench/scale.py, not this file. -->",
        "",
        "On paper, from costs measured on one small machine. Every figure below is either **measured** here (a key "
        "in `bench/results/*.json`, named beside it), **assumed** (the table just below, the only figures typed in, "
        "in `bench/scale.py`), or **computed** from those two by the formula beside it. Nothing at 1k or 10k workers "
        "was run: the largest index measured here holds 10M holder-blocks over 256 workers, and the largest group "
        "is the `--measure` run's (see *Measured here*).",
        "",
        "## Assumptions",
        "",
        *_assumption_table(),
        "",
        *_worker_lines(),
        "",
        "## Per-unit costs (measured here)",
        "",
        "| cost | value | from |",
        "|---|---|---|",
        f"| index bytes per holder-block, process RSS growth | {_unit(c['bytes_rss'].value, 'B')} | {c['bytes_rss'].source} (own count: {fmt(c['bytes_own'].value)} B, {c['bytes_own'].source}) |",
        f"| apply, blocks/s, one member through the broker | {fmt(c['apply_member'].value)} | {c['apply_member'].source} |",
        f"| HTTP scores/s, one member, 32 connections | {fmt(c['http_rps'].value)} | {c['http_rps'].source} |",
        f"| member CPU per HTTP score | {_us(c['peer_cpu_us'].value)} | {c['peer_cpu_us'].source} |",
        f"| fetch alone, blocks/s, one consumer | {fmt(c['fetch_blocks'].value)} ({fmt(c['fetch_mb'].value)} MB/s) | {c['fetch_blocks'].source}, `mb_per_s` |",
        f"| record value bytes per stored block, 8-block records | {_unit(c['store_bytes'].value, 'B')} | {c['store_bytes'].source} |",
        f"| record value bytes per removed block | {_unit(c['remove_bytes'].value, 'B')} | {c['remove_bytes'].source} |",
        f"| cold start from a snapshot, s per million holder-blocks | {fmt(c['cold_start'].value)} | {c['cold_start'].source} |",
        f"| replay from the log, blocks/s | {fmt(c['replay_rate'].value)} | {c['replay_rate'].source} |",
        f"| asking member's CPU per peer of a scatter | {_us(c['ask_cpu_per_peer_us'].value)} | {c['ask_cpu_per_peer_us'].source} |",
        "",
        "These were measured on a shared 2-CPU VM (machines and dates at the end); each member applies on one event "
        "loop, so what counts is one core's speed, likely higher on a production host: the member counts below "
        "are an upper bound for today's code. Per-holder-block memory and "
        "apply rate are taken as constant beyond the 10M holder-blocks measured (bytes per holder-block fell from "
        f"{fmt(_get(res, 'index_memory', '1M', 'bytes_per_holder_block'))} B at 1M to {fmt(c['bytes_own'].value)} B "
        "at 10M, `index_memory.json`), and removals are costed as stores.",
        "",
        "## Index members",
        "",
        *_table(_rows(c), figs),
        "",
        *_scatter_lines(c, figs, pts),
        "",
        *_reading(figs),
        "",
        "## Kafka",
        "",
        *_table(_broker_rows(c), figs),
        "",
        f"The measured fetch figure is one consumer's client side on this machine, the broker on the same 2 CPUs "
        f"({c['fetch_blocks'].source}): a floor for a broker's egress, not a broker limit. The whole pipeline "
        f"(publisher, broker and member on this machine) "
        + (
            f"saturated at {fmt(lag.value)} blocks/s offered ({lag.source})"
            if lag.value
            else f"did not saturate up to {fmt(lag_top.value)} blocks/s offered, its top level ({lag_top.source})"
        )
        + "; a broker's own capacity is not measured here.",
        "",
        *_partition_lines(figs),
        "",
        "## Measured here",
        "",
        *_measured_lines(res),
        "",
        "## Machines and dates",
        "",
        *_machines(res),
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------- --measure


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _workload_rounds(holder_blocks: int) -> int:
    from .index_memory import CONV_BLOCKS, N_WORKERS

    return math.ceil(holder_blocks / (N_WORKERS * CONV_BLOCKS))


def _conversations(holder_blocks: int, keep: Callable[[int], bool]):
    """bench.index_memory's workload, every worker's conversations generated in the same order
    (so the stored ones queries reuse are the same in every process), ``keep`` choosing which
    workers' events this process applies."""
    from .index_memory import N_WORKERS, Workload

    wl = Workload()
    for c in range(_workload_rounds(holder_blocks)):
        for w in range(N_WORKERS):
            evs = wl.conversation(w, c)
            if keep(w):
                yield wl.workers[w], evs
    yield None, wl


def serve_main(ns: argparse.Namespace) -> None:
    import asyncio

    from kvwire.consumer.apply import Applier
    from kvwire.consumer.http import make_app, serve
    from kvwire.consumer.index import PrefixIndex

    ix = PrefixIndex()
    for rank, evs in _conversations(ns.holder_blocks, lambda w: w % ns.members == ns.member):
        if rank is None:
            break
        for i in range(0, len(evs), 2):
            ix.apply_batch(rank, evs[i : i + 2])
    applier = Applier(index=ix)
    peers = [p for p in ns.peers.split(",") if p]

    async def main() -> None:
        app = make_app(applier, lambda: True, peers=peers)
        runner = await serve(app, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        print(json.dumps({"port": port, "holder_blocks": len(ix)}), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await runner.cleanup()

    asyncio.run(main())


def _start(member: int, members: int, holder_blocks: int, peers: list[str]) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "bench.scale", "serve", "--member", str(member), "--members", str(members)]
    cmd += ["--holder-blocks", str(holder_blocks), "--peers", ",".join(peers)]
    p = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, json.loads(p.stdout.readline())["port"]


def _time_queries(port: int, bodies: list[bytes], top_k: int) -> list[float]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port)
    out = []
    for body in bodies:
        t0 = time.perf_counter()
        conn.request("POST", f"/v1/score?top_k={top_k}", body, {"content-type": "application/octet-stream"})
        r = conn.getresponse()
        r.read()
        out.append((time.perf_counter() - t0) * 1e6)
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
    conn.close()
    return out


def _one_group(members: int, holder_blocks: int, bodies: list[bytes], top_k: int) -> dict[str, Any]:
    from .common import percentiles

    procs: list[subprocess.Popen] = []
    try:
        ports = []
        for m in range(1, members):
            p, port = _start(m, members, holder_blocks, [])
            procs.append(p)
            ports.append(port)
        p0, port0 = _start(0, members, holder_blocks, [f"http://127.0.0.1:{x}" for x in ports])
        procs.insert(0, p0)
        _time_queries(port0, bodies[:50], top_k)  # warm the peers' sessions and caches
        cpu0 = [_cpu_s(p.pid) for p in procs]
        lat = _time_queries(port0, bodies, top_k)
        cpu = [(_cpu_s(p.pid) - c) * 1e6 / len(bodies) for p, c in zip(procs, cpu0, strict=True)]
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            p.wait(timeout=30)
    pc = percentiles(lat, (50, 90, 99, 99.9))
    return {
        "members": members,
        "requests": len(lat),
        "p50_us": round(pc["p50"], 1),
        "p90_us": round(pc["p90"], 1),
        "p99_ms": round(pc["p99"] / 1000, 3),
        "p999_ms": round(pc["p99.9"] / 1000, 3),
        "max_ms": round(max(lat) / 1000, 3),
        "ask_cpu_us": round(cpu[0], 1),
        "peer_cpu_us": round(sum(cpu[1:]) / len(cpu[1:]), 1) if members > 1 else None,
    }


def _slope(xs: list[float], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def _removal_bytes(blocks: int) -> float:
    """Value bytes per block of one record removing ``blocks`` blocks, as the publisher encodes it."""
    from kvwire.schemas import codec
    from kvwire.schemas.events import BlockRemoved, EventBatch, WorkerId

    hashes = tuple(range(2**62, 2**62 + blocks))
    batch = EventBatch(WorkerId("worker-0", 0, 0, 1, "m"), 2**62, 1000, 0, (BlockRemoved(hashes, medium="GPU"),))
    return round(len(codec.encode(batch)) / blocks, 2)


def measure(holder_blocks: int, queries: int, max_members: int, top_k: int = 16) -> Path:
    import numpy as np

    from .common import write_result
    from .score_latency import queries as make_queries

    *_, (_, wl) = _conversations(holder_blocks, lambda w: False)
    bodies = [np.ascontiguousarray(q, "<u4").tobytes() for q in make_queries(wl, 8192, queries)]
    before = os.getloadavg()
    runs = [_one_group(m, holder_blocks, bodies, top_k) for m in range(1, max_members + 1)]
    xs = [float(r["members"] - 1) for r in runs]
    from .index_memory import CONV_BLOCKS, N_WORKERS

    data = {
        "what": "scatter cost: one group of M members on this machine, sequential binary scores to member 0",
        "params": {
            "holder_blocks": _workload_rounds(holder_blocks) * N_WORKERS * CONV_BLOCKS,
            "workers": N_WORKERS,
            "queries": queries,
            "top_k": top_k,
            "blocks_per_record": int(assume("blocks_per_record")),
            "loadavg_before": round(before[0], 2),
            "loadavg_after": round(os.getloadavg()[0], 2),
        },
        "runs": runs,
        "fit": {
            "ask_cpu_us_per_peer": round(_slope(xs, [r["ask_cpu_us"] for r in runs]), 1),
            "latency_us_per_peer": round(_slope(xs, [r["p50_us"] for r in runs]), 1),
        },
        "removal_value_bytes_per_block": _removal_bytes(int(assume("blocks_per_record"))),
    }
    return write_result("scale", data)


# ---------------------------------------------------------------- entry


def write(results: Path = RESULTS, doc: Path = DOC) -> Path:
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(load(results)))
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    sv = sub.add_parser("serve", help="one member of a --measure group (internal)")
    sv.add_argument("--member", type=int, required=True)
    sv.add_argument("--members", type=int, required=True)
    sv.add_argument("--holder-blocks", type=int, required=True)
    sv.add_argument("--peers", default="")
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/scale.md is not what this generates")
    ap.add_argument("--measure", action="store_true", help="measure scatter with 1..4 members first (< 1 min)")
    ap.add_argument("--holder-blocks", type=int, default=1_000_000)
    ap.add_argument("--queries", type=int, default=1500)
    ap.add_argument("--max-members", type=int, default=4)
    ns = ap.parse_args(argv)
    if ns.cmd == "serve":
        serve_main(ns)
        return 0
    if ns.check:
        fresh = render(load())
        if not DOC.exists() or DOC.read_text() != fresh:
            print("stale: docs/scale.md (run python -m bench.scale)", file=sys.stderr)
            return 1
        return 0
    if ns.measure:
        print(f"wrote {measure(ns.holder_blocks, ns.queries, ns.max_members).relative_to(ROOT)}")
    print(f"wrote {write().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
