"""kvwire's side of the peers run: its core through Python, as ``bench.index_memory`` (apply)
and ``bench.score_latency`` (score) measure it, on a dump of ``dump.py``.

    python -m bench.peers.kvwire_side DUMP ANSWERS

Prints one JSON object with the same fields as the Rust harness (``src/main.rs``) and writes
every query's per-worker matched blocks to ANSWERS. Apply: the consumer's own path, Kafka
records' bytes through ``Applier.apply_records`` (the core decodes, fences, hashes and applies
them), of BlockStored events built as ``Workload.conversation`` builds them, ``events_per_record``
per record, timed per conversation (building and encoding the records is not timed, as the
broker hands a consumer bytes). Score: ``PrefixIndex.score_arrays(tokens)``, every matched
worker, hashing included.
"""

from __future__ import annotations

import json
import sys
import time
from array import array
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvwire.consumer.apply import Applier
from kvwire.consumer.index import PrefixIndex
from kvwire.schemas import codec
from kvwire.schemas.events import BlockStored, EventBatch

from ..index_memory import Workload
from .dump import Dump, Header, write_answers


def rss_anon_bytes() -> int:
    """Anonymous resident memory: the index's heap, not the dump's page cache."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def events(h: Header, hashes: np.ndarray, tokens: np.ndarray) -> list[BlockStored]:
    """One conversation's BlockStored events, field for field as ``Workload.conversation``."""
    bs, per = h.block_size, h.blocks_per_event
    out = []
    for a in range(0, len(hashes), per):
        b = min(a + per, len(hashes))
        t = array("I")
        t.frombytes(tokens[a * bs : b * bs].tobytes())
        out.append(BlockStored(tuple(hashes[a:b].tolist()), int(hashes[a - 1]) if a else None, t, bs, medium="GPU"))
    return out


class _Record(NamedTuple):
    """What a Kafka consumer hands the applier: offset, key, value, timestamp."""

    offset: int
    key: bytes | None
    value: bytes
    timestamp: int


def run(dump_path: Path, answers_path: Path) -> dict:
    d = Dump(dump_path)
    h = d.header
    ranks = Workload().workers[: h.workers]  # the bench's worker ids; the index maps them to 0..n-1
    rss0 = rss_anon_bytes()
    ix = PrefixIndex()
    applier = Applier(ix)
    seqs = [0] * h.workers
    offset = 0
    cpu, clock = time.thread_time_ns, time.perf_counter_ns
    apply_cpu = apply_wall = 0
    blocks = 0
    for w, hashes, tokens in d.conversations():
        evs = events(h, hashes, tokens)
        rank = ranks[w]
        k = h.events_per_record
        recs = []
        for i in range(0, len(evs), k):
            seq = seqs[w]
            seqs[w] += 1
            batch = EventBatch(rank, 1, seq, 0, tuple(evs[i : i + k]), reset=seq == 0)
            recs.append(_Record(offset, None, codec.encode(batch), 0))
            offset += 1
        c0, t0 = cpu(), clock()
        done = applier.apply_records("peers", 0, recs, budget_us=1 << 40)
        apply_wall += clock() - t0
        apply_cpu += cpu() - c0
        if done != len(recs) or applier.dead_letters:
            raise SystemExit(f"kvwire applied {done} of {len(recs)} records: {applier.dead_letters[:1]}")
        blocks += len(hashes)
        del recs
    rss1 = rss_anon_bytes()
    if len(ix) != h.holder_blocks:
        raise SystemExit(f"kvwire holds {len(ix):,} holder-blocks, the dump says {h.holder_blocks:,}")
    qs = d.queries()
    d.close()
    for q in qs[: h.warmup]:
        ix.score_arrays(q)
    cpu_us, wall_us = [], []
    for q in qs:  # as bench.score_latency._time: the answer is freed inside the timing
        c0, t0 = cpu(), clock()
        ix.score_arrays(q)
        t1 = clock()
        cpu_us.append((cpu() - c0) / 1e3)
        wall_us.append((t1 - t0) / 1e3)
    index_of = {(r.instance_id, r.dp_rank): i for i, r in enumerate(ranks)}
    answers = []
    for q in qs:
        r = ix.score_arrays(q)
        row = []
        for w, m in zip(r.worker.tolist(), r.matched_tokens.tolist(), strict=True):
            row.append((index_of[ix.worker_key(w)], m // h.block_size))
        answers.append(row)
    write_answers(answers_path, answers)
    return {
        "index": "kvwire",
        "holder_blocks": h.holder_blocks,
        "tree_holder_blocks": len(ix),
        "blocks_applied": blocks,
        "apply_cpu_s": apply_cpu / 1e9,
        "apply_wall_s": apply_wall / 1e9,
        "rss_anon_growth_bytes": rss1 - rss0,
        "own_bytes_per_holder_block": ix.nbytes() / len(ix),
        "score_cpu_us": cpu_us,
        "score_wall_us": wall_us,
    }


if __name__ == "__main__":
    print(json.dumps(run(Path(sys.argv[1]), Path(sys.argv[2]))))
