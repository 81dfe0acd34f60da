"""Score latency: p50/p99 of one routing query, by prompt length and index size.

Index: bench.index_memory's workload (256 workers, 8k-token conversations over 16 shared
64-block system prompts) built to 1M and 10M holder-blocks (``--quick``: 1M). Queries of
1k, 8k and 32k tokens, three kinds interleaved: a stored conversation (long hit on one
worker, its system prompt on ~16 others), a system prompt followed by new text, and a miss.

Per query, four timings:

- ``with_hashing``: ``PrefixIndex.score(tokens)`` — what a router calls;
- ``without_hashing``: ``score_keys(prompt_keys(tokens))`` with the keys precomputed (a router
  that caches a conversation's keys; SGLang SMG's published figures exclude hashing too);
- ``hashing_only``: ``prompt_keys(tokens)``;
- ``scan_only``: the jitted table walk alone, no result objects (private ``_run``; null when
  the index no longer has it), so ``without_hashing - scan_only`` is result building.

Each is reported as wall-clock percentiles and, under ``cpu_time``, as on-CPU percentiles
(``thread_time_ns``): the difference is time the query spent preempted.

    python -m bench.score_latency [--quick] [--queries N]

Writes bench/results/score_latency.json.
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np

from kvwire.consumer.keys import prompt_keys

from .common import percentiles, write_result
from .index_memory import BS, N_SYS, N_WORKERS, Workload, build

PROMPT_TOKENS = (1024, 8192, 32768)
PS = (50, 99, 99.9)


def queries(wl: Workload, tokens: int, n: int, seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + tokens)
    out = []
    for i in range(n):
        k = i % 3
        if k == 0 and wl.kept:
            base = wl.kept[i % len(wl.kept)]
        elif k == 1:
            base = wl.sys[i % N_SYS]
        else:
            base = np.zeros(0, np.uint32)
        q = base[:tokens]
        if q.shape[0] < tokens:
            q = np.concatenate([q, rng.integers(0, 128_000, tokens - q.shape[0], dtype=np.uint32)])
        out.append(q)
    return out


def _scan_fn(ix):
    """The table walk alone through PrefixIndex internals; None when they moved."""
    try:
        from kvwire.consumer import index as I

        wmask, warr = ix._query_args(None, None)
        no_tok, no_ctx = I._NO_TOKENS, I._NO_CTX
        run = ix._run
        f = lambda keys: run(no_tok, 0, keys.shape[0], no_ctx, keys, wmask, warr, scale=BS)
        f(prompt_keys(np.zeros(BS * 4, np.uint32), BS))
        return f
    except Exception:
        return None


def _time(fn, items) -> tuple[list[float], list[float]]:
    """Wall and on-CPU microseconds per call: on a shared machine the wall-clock tail is mostly
    the scheduler (a preempted query waits a whole time slice); CPU time shows the query's own."""
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    wall, oncpu = [], []
    for it in items:
        c0 = cpu()
        t0 = clock()
        fn(it)
        t1 = clock()
        oncpu.append((cpu() - c0) / 1e3)
        wall.append((t1 - t0) / 1e3)
    return wall, oncpu


def measure(ix, wl: Workload, n: int) -> dict:
    res = {}
    scan = _scan_fn(ix)
    for tokens in PROMPT_TOKENS:
        qs = queries(wl, tokens, n)
        keys = [prompt_keys(q, BS) for q in qs]
        for q in qs[:20]:  # warm caches and any lazy compilation
            ix.score(q)
        gc.collect()
        row = {"cpu_time": {}}
        modes = [
            ("with_hashing", ix.score, qs),
            ("without_hashing", lambda k: ix.score_keys(k, BS), keys),
            ("hashing_only", lambda q: prompt_keys(q, BS), qs),
        ]
        if scan is not None:
            modes.append(("scan_only", scan, keys))
        for name, fn, items in modes:
            wall, oncpu = _time(fn, items)
            row[name] = {k: round(v, 2) for k, v in percentiles(wall, PS).items()}
            row["cpu_time"][name] = {k: round(v, 2) for k, v in percentiles(oncpu, PS).items()}
            if name in ("with_hashing", "without_hashing"):  # the mix hides that misses are cheap
                row.setdefault("p50_by_kind", {})[name] = {
                    kind: percentiles(wall[i::3], (50,))["p50"] and round(percentiles(wall[i::3], (50,))["p50"], 2)
                    for i, kind in enumerate(("stored_conversation", "system_prompt_then_new", "miss"))
                }
        if scan is None:
            row["scan_only"] = None
        hits = [len(ix.score(q)) for q in qs[:30]]
        row["workers_matched_per_query"] = {"max": max(hits), "mean": round(sum(hits) / len(hits), 1)}
        res[f"{tokens // 1024}k"] = row
    return res


def run(sizes, n: int) -> dict:
    out = {
        "what": "score latency, microseconds per query",
        "params": {
            "workers": N_WORKERS,
            "block_size": BS,
            "queries_per_point": n,
            "prompt_tokens": list(PROMPT_TOKENS),
            "query_mix": "1/3 stored conversation, 1/3 system prompt + new text, 1/3 miss",
        },
        "sizes": {},
    }
    for target in sizes:
        gc.collect()
        wl = Workload()
        t0 = time.perf_counter()
        ix, _, _ = build(target, wl)
        label = f"{target / 1e6:g}M"
        row = {"holder_blocks": len(ix), "build_s": round(time.perf_counter() - t0, 1)}
        row.update(measure(ix, wl, n))
        out["sizes"][label] = row
        for t in PROMPT_TOKENS:
            r = row[f"{t // 1024}k"]
            print(
                f"{label:>5} {t:>6} tokens: with hashing p50 {r['with_hashing']['p50']:>8} p99 {r['with_hashing']['p99']:>9} | "
                f"without p50 {r['without_hashing']['p50']:>8} p99 {r['without_hashing']['p99']:>9} us"
            )
        del ix, wl
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M holder-blocks only (default 1M and 10M)")
    ap.add_argument("--sizes", type=int, nargs="*", default=None, help="holder-block targets")
    ap.add_argument("--queries", type=int, default=None, help="queries per (size, length) point")
    a = ap.parse_args(argv)
    sizes = a.sizes or ([1_000_000] if a.quick else [1_000_000, 10_000_000])
    n = a.queries or (900 if a.quick else 3000)
    print("wrote", write_result("score_latency", run(sizes, n)))


if __name__ == "__main__":
    main()
