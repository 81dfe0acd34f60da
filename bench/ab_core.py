"""A/B two builds of the Rust core on the score and apply workloads, in alternating pairs.

    python -m bench.ab_core NEW.so OLD.so [--size 10000000] [--queries 900] [--pairs 3]

Each side runs in its own process with ``kvwire._core`` loaded from the given file (a copy of
``kvwire/_core.abi3.so`` from each build), so both see the same Python code and workload. Pairs
alternate A, B, A, B...: on a shared, noisy machine the ratio within a pair is what to quote.
Prints per pair the on-CPU score latency (8k-token prompts, ``bench.score_latency``'s query mix
and index: top 16, every matched worker as the peers run asks, and top 16 of keys given) and
the apply rate of pre-fetched records (``bench.apply_rate``'s core pipeline) and the on-CPU
cost of applying ``bench.lag``'s records (a cache turning over: stores and removes).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time


def _load_core(path: str):
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader("kvwire._core", path)
    spec = importlib.util.spec_from_file_location("kvwire._core", path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    sys.modules["kvwire._core"] = mod
    import kvwire

    kvwire._core = mod  # type: ignore[attr-defined]
    return mod


def _side(core_path: str, size: int, n: int, apply_blocks: int) -> dict:
    core = _load_core(core_path)
    from kvwire.consumer.apply import Applier
    from kvwire.consumer.keys import prompt_keys
    from kvwire.schemas import codec

    from .apply_rate import _timed, make_records
    from .common import percentiles
    from .index_memory import BS, Workload, build
    from .lag import churn_records
    from .score_latency import _time, queries

    def score(ix, wl) -> dict:
        qs = queries(wl, 8192, n)
        keys = [prompt_keys(q, BS) for q in qs]
        res = {}
        for name, fn, items in (
            ("top16", lambda q: ix.score_arrays(q, top_k=16), qs),
            # Every matched worker, as the peers run scores (its own ordering path in the core).
            ("all", lambda q: ix.score_arrays(q), qs),
            ("keys_top16", lambda k: ix.score_keys_arrays(k, BS, top_k=16), keys),
        ):
            for it in items[:30]:
                fn(it)
            gc.collect()
            _, cpu = _time(fn, items)
            row = {"p50": percentiles(cpu, (50,))["p50"], "p99": percentiles(cpu, (99,))["p99"]}
            for i, kind in enumerate(("stored_conversation", "system_prompt_then_new", "miss")):
                row[f"p50_{kind}"] = percentiles(cpu[i::3], (50,))["p50"]
            res[name] = {k: round(v, 1) for k, v in row.items()}
        return res

    wl = Workload()
    out: dict = score(build(size, wl)[0], wl)
    gc.collect()
    values = [v for _, v in make_records(apply_blocks, 2)]
    nblocks = sum(codec.decode(v).block_count() for v in values)

    def pipeline() -> None:
        ap = Applier()
        i, now = 0, time.time_ns() // 1000
        while i < len(values):
            i = core.apply_poll(ap.index.core, ap.ranks.core, values, i, 10**12, now).next

    out["apply_blocks_per_s"] = round(nblocks / _timed(pipeline, 3))

    # The member's work in bench.lag: a cache turning over (stores and removes), small index.
    head, body = churn_records(4)

    def churn() -> float:
        """On-CPU seconds of the body, applied after the head."""
        ap = Applier()
        now = time.time_ns() // 1000

        def apply(vals: list[bytes]) -> None:
            i = 0
            while i < len(vals):
                i = core.apply_poll(ap.index.core, ap.ranks.core, vals, i, 10**12, now).next

        apply(head)
        t0 = time.thread_time()
        apply(body)
        return time.thread_time() - t0

    out["churn_apply_us_per_record"] = round(min(churn() for _ in range(3)) / len(body) * 1e6, 3)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="core build A (e.g. the new one)")
    ap.add_argument("b", help="core build B (the baseline)")
    ap.add_argument("--size", type=int, default=10_000_000, help="holder-blocks in the scored index")
    ap.add_argument("--queries", type=int, default=900)
    ap.add_argument("--apply-blocks", type=int, default=2_000_000)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        print(json.dumps(_side(a.side, a.size, a.queries, a.apply_blocks)))
        return

    def run(path: str) -> dict:
        cmd = [sys.executable, "-m", "bench.ab_core", a.a, a.b, "--side", path]
        cmd += ["--size", str(a.size), "--queries", str(a.queries), "--apply-blocks", str(a.apply_blocks)]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])

    ratios: dict[str, list[float]] = {}
    for p in range(a.pairs):
        ra, rb = run(a.a), run(a.b)
        flat = {
            "apply_blocks_per_s": (ra["apply_blocks_per_s"], rb["apply_blocks_per_s"]),
            "churn_apply_us_per_record": (ra["churn_apply_us_per_record"], rb["churn_apply_us_per_record"]),
            **{f"{m}.{k}": (ra[m][k], rb[m][k]) for m in ("top16", "all", "keys_top16") for k in ra[m]},
        }
        print(f"pair {p + 1}: " + ", ".join(f"{k} {x:g} vs {y:g}" for k, (x, y) in flat.items()), flush=True)
        for k, (x, y) in flat.items():
            ratios.setdefault(k, []).append(x / y if y else float("nan"))
    print("A/B, median over pairs (for latencies and churn lower is better, for apply higher):")
    for k, rs in ratios.items():
        print(f"  {k:<40} x{statistics.median(rs):.2f}  ({', '.join(f'{r:.2f}' for r in rs)})")


if __name__ == "__main__":
    main()
