"""PrefixIndex benchmark: bytes per holder-block, apply rate, score latency.

Workload: 256 workers (tp 1, GPU blocks of 16 tokens). Each worker serves
conversations of 512 blocks (8k tokens) that start with one of 16 shared
system prompts (64 blocks); BlockStored events carry 16 blocks each and chain
from the previous event's last hash, engine hashes are random 64-bit ints (as
vLLM's). Sizes: 1M holder-blocks (``--quick``) and 10M.

Score latency is for 8k-token queries over the 1M index, three kinds mixed:
a stored conversation (long hit on one worker, system prompt on ~16), a system
prompt plus new text, and a miss; "with hashing" is ``score(tokens)``,
"without" is ``score_keys(prompt_keys(...))`` with the keys precomputed.

Prints a table and writes ``bench/results/index_memory.json``.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import numpy as np

from kvwire.consumer.index import PrefixIndex
from kvwire.consumer.keys import prompt_keys
from kvwire.schemas.events import BlockRemoved, BlockStored, WorkerId

from .common import percentiles, write_result

BS = 16
CONV_BLOCKS = 512
SYS_BLOCKS = 64
EV_BLOCKS = 16
N_WORKERS = 256
N_SYS = 16


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Workload:
    def __init__(self, seed: int = 0, name: str = "vllm"):
        self.rng = np.random.default_rng(seed)
        self.sys = [self.rng.integers(0, 128_000, SYS_BLOCKS * BS, dtype=np.uint32) for _ in range(N_SYS)]
        self.sys_hashes = [
            self.rng.integers(0, 2**64, SYS_BLOCKS, dtype=np.uint64, endpoint=False) for _ in range(N_SYS)
        ]
        self.workers = [WorkerId(f"{name}-{i}", 0, 0, 1, "m") for i in range(N_WORKERS)]
        self.kept: list[np.ndarray] = []  # some stored conversations, to query later

    def conversation(self, w: int, c: int):
        """Events for one conversation of worker w: (tokens, hashes) per event."""
        s = (w + c) % N_SYS
        tail = self.rng.integers(0, 128_000, (CONV_BLOCKS - SYS_BLOCKS) * BS, dtype=np.uint32)
        toks = np.concatenate([self.sys[s], tail])
        hashes = np.concatenate(
            [self.sys_hashes[s], self.rng.integers(0, 2**64, CONV_BLOCKS - SYS_BLOCKS, dtype=np.uint64, endpoint=False)]
        )
        if len(self.kept) < 64 and self.rng.random() < 0.05:
            self.kept.append(toks)
        evs = []
        for e in range(CONV_BLOCKS // EV_BLOCKS):
            a, b = e * EV_BLOCKS, (e + 1) * EV_BLOCKS
            parent = int(hashes[a - 1]) if a else None
            evs.append(
                BlockStored(
                    tuple(hashes[a:b].tolist()),
                    parent,
                    toks[a * BS : b * BS].tobytes() and _arr(toks[a * BS : b * BS]),
                    BS,
                    medium="GPU",
                )
            )
        return evs


def _arr(a: np.ndarray):
    from array import array

    out = array("I")
    out.frombytes(a.tobytes())
    return out


def build(target: int, wl: Workload):
    ix = PrefixIndex()
    applied = 0
    t_apply = 0.0
    c = 0
    while len(ix) < target:
        for w in range(N_WORKERS):
            evs = wl.conversation(w, c)
            rank = wl.workers[w]
            t0 = time.perf_counter()
            for i in range(0, len(evs), 2):  # two events per record, as the publisher batches them
                ix.apply_batch(rank, evs[i : i + 2])
            t_apply += time.perf_counter() - t0
            applied += CONV_BLOCKS
            if len(ix) >= target:
                break
        c += 1
    return ix, applied, t_apply


def removal_rate(ix: PrefixIndex, wl: Workload, n_conv: int = 64) -> float:
    # Store then remove fresh conversations: measures BlockRemoved cost at this size.
    evs = [(wl.workers[i % N_WORKERS], wl.conversation(i % N_WORKERS, 10_000 + i)) for i in range(n_conv)]
    for r, es in evs:
        ix.apply_batch(r, es)
    rms = [(r, BlockRemoved(e.block_hashes, medium="GPU")) for r, es in evs for e in es]
    t0 = time.perf_counter()
    for r, e in rms:
        ix.apply_batch(r, (e,))
    return len(rms) * EV_BLOCKS / (time.perf_counter() - t0)


def latency(ix: PrefixIndex, wl: Workload, n: int = 2000) -> dict:
    rng = np.random.default_rng(1)
    qs = []
    for i in range(n):
        k = i % 3
        if k == 0 and wl.kept:
            q = wl.kept[i % len(wl.kept)]
        elif k == 1:
            q = np.concatenate(
                [wl.sys[i % N_SYS], rng.integers(0, 128_000, (CONV_BLOCKS - SYS_BLOCKS) * BS, dtype=np.uint32)]
            )
        else:
            q = rng.integers(0, 128_000, CONV_BLOCKS * BS, dtype=np.uint32)
        qs.append(q)
    keys = [prompt_keys(q, BS) for q in qs]
    out = {}
    for name, fn in (
        ("score_with_hashing", lambda i: ix.score(qs[i])),
        ("score_without_hashing", lambda i: ix.score_keys(keys[i], BS)),
        ("hashing_only", lambda i: prompt_keys(qs[i], BS)),
    ):
        for i in range(50):  # each mode warms its own path
            fn(i)
        ts = []
        for i in range(n):
            t0 = time.perf_counter_ns()
            fn(i)
            ts.append((time.perf_counter_ns() - t0) / 1e3)
        out[name] = {k: round(v, 2) for k, v in percentiles(ts).items()}
    hits = [len(ix.score(q)) for q in qs[:30]]
    out["workers_matched_per_query"] = {"max": max(hits), "mean": round(sum(hits) / len(hits), 1)}
    return out


def run(sizes, score_at=1_000_000) -> dict:
    res = {
        "workload": {
            "workers": N_WORKERS,
            "block_size": BS,
            "conversation_blocks": CONV_BLOCKS,
            "system_prompt_blocks": SYS_BLOCKS,
            "blocks_per_event": EV_BLOCKS,
            "system_prompts": N_SYS,
        }
    }
    for target in sizes:
        gc.collect()
        wl = Workload()
        rss0 = _rss_mb()
        ix, applied, t = build(target, wl)
        hb = len(ix)
        row = {
            "holder_blocks": hb,
            "engine_entries": ix.entries(),
            "nbytes": ix.nbytes(),
            "bytes_per_holder_block": round(ix.nbytes() / hb, 2),
            "peak_rss_growth_mb": round(_rss_mb() - rss0, 1),
            "blocks_applied": applied,
            "apply_blocks_per_s": round(applied / t),
        }
        row["remove_blocks_per_s"] = round(removal_rate(ix, wl))
        if target == score_at:
            row["latency_us_8k_tokens"] = latency(ix, wl)
        res[f"{target // 1_000_000}M"] = row
        print(
            f"{target:>11,} holder-blocks: {row['bytes_per_holder_block']:.1f} B/holder-block "
            f"({row['nbytes'] / 2**20:.0f} MiB), apply {row['apply_blocks_per_s'] / 1e6:.2f}M blocks/s, "
            f"remove {row['remove_blocks_per_s'] / 1e6:.2f}M blocks/s"
        )
        if "latency_us_8k_tokens" in row:
            for k, v in row["latency_us_8k_tokens"].items():
                print(f"    {k:24s} {v}")
        del ix, wl
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1M holder-blocks only")
    a = ap.parse_args(argv)
    res = run([1_000_000] if a.quick else [1_000_000, 10_000_000])
    print("wrote", write_result("index_memory", res))


if __name__ == "__main__":
    main()
