"""What scoring a hybrid model's workers group by group costs, beside the same fleet as plain
full-attention workers.

Workload: bench.index_memory's (256 workers, 8k-token conversations over 16 shared system
prompts, 16-token blocks) built to ``--blocks`` full-attention holder-blocks. The hybrid fleet
stores every conversation twice, as vLLM 0.33 emits it for a model with a full-attention group
(``group_idx`` 0) and a sliding-window group (1, window ``--window`` tokens), then removes the
window group's blocks that left the window (what vLLM's eviction ends up reporting). Queries:
8k tokens, a stored conversation, a system prompt plus new text, and a miss, interleaved.

Timed per query: ``score_arrays(tokens, top_k=16)`` (hashing, walk, ordering in the core), as
wall-clock and on-CPU percentiles; and the apply rate of building each index (blocks named by
the events per second, Python event objects through ``apply_batch``).

    python -m bench.hybrid [--blocks N] [--queries N] [--window TOKENS]

Writes bench/results/hybrid.json.
"""

from __future__ import annotations

import argparse
import gc
import time

import msgspec
import numpy as np

from kvwire.consumer.index import PrefixIndex
from kvwire.schemas.events import BlockRemoved

from .common import percentiles, write_result
from .index_memory import BS, CONV_BLOCKS, N_WORKERS, Workload
from .score_latency import queries


def build(conversations: int, window: int | None, seed: int = 0) -> tuple[PrefixIndex, Workload, float]:
    """``conversations`` stored round-robin over the workers (the same ones for both fleets)."""
    wl = Workload(seed)
    ix = PrefixIndex()
    need = None if window is None else -(-(window - 1) // BS)
    named, spent = 0, 0.0
    for n in range(conversations):
        w, c = n % N_WORKERS, n // N_WORKERS
        evs = wl.conversation(w, c)
        rank = wl.workers[w]
        if need is None:
            batches = [evs[i : i + 2] for i in range(0, len(evs), 2)]
        else:
            full = [msgspec.structs.replace(e, group_idx=0, kv_cache_spec_kind="full_attention") for e in evs]
            swa = [
                msgspec.structs.replace(
                    e, group_idx=1, kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=window
                )
                for e in evs
            ]
            hashes = [h for e in evs for h in e.block_hashes]
            left = BlockRemoved(tuple(hashes[:-need]), medium="GPU", group_idx=1)
            batches = [full[i : i + 2] + swa[i : i + 2] for i in range(0, len(evs), 2)] + [[left]]
        t0 = time.perf_counter()
        for b in batches:
            ix.apply_batch(rank, b)
        spent += time.perf_counter() - t0
        named += sum(len(e.block_hashes) for b in batches for e in b)
    return ix, wl, named / spent


def score_times(ix: PrefixIndex, qs: list[np.ndarray]) -> dict:
    for q in qs[:200]:  # warm
        ix.score_arrays(q, top_k=16)
    wall, cpu = [], []
    gc.disable()
    try:
        for q in qs:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            ix.score_arrays(q, top_k=16)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            wall.append((t1 - t0) / 1000)
            cpu.append((c1 - c0) / 1000)
    finally:
        gc.enable()
    return {"wall_us": percentiles(wall, (50, 99)), "cpu_us": percentiles(cpu, (50, 99))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="conversation blocks stored (per group)")
    ap.add_argument("--queries", type=int, default=3000)
    ap.add_argument("--window", type=int, default=1024, help="sliding window, tokens")
    a = ap.parse_args(argv)
    conversations = -(-a.blocks // CONV_BLOCKS)
    out: dict = {"conversations": conversations, "window_tokens": a.window, "prompt_tokens": 8192, "top_k": 16}
    for name, window in (("plain", None), ("hybrid", a.window)):
        ix, wl, rate = build(conversations, window)
        qs = queries(wl, 8192, a.queries)
        out[name] = {
            "holder_blocks": len(ix),
            "index_bytes": ix.nbytes(),
            "apply_blocks_per_s": round(rate),
            "score": score_times(ix, qs),
            "matched_per_query": float(np.mean([len(ix.score_arrays(q, top_k=16).worker) for q in qs[:300]])),
        }
        print(name, out[name], flush=True)
        del ix, wl
        gc.collect()
    p, h = out["plain"]["score"], out["hybrid"]["score"]
    out["hybrid_over_plain"] = {
        "score_p50_wall": round(h["wall_us"]["p50"] / p["wall_us"]["p50"], 2),
        "score_p50_cpu": round(h["cpu_us"]["p50"] / p["cpu_us"]["p50"], 2),
        "score_p99_cpu": round(h["cpu_us"]["p99"] / p["cpu_us"]["p99"], 2),
        "apply_rate": round(out["hybrid"]["apply_blocks_per_s"] / out["plain"]["apply_blocks_per_s"], 2),
    }
    print("hybrid / plain:", out["hybrid_over_plain"])
    write_result("hybrid", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
