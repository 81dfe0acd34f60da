"""The peers' workload file: ``bench.index_memory.Workload`` and ``bench.score_latency.queries``,
written once so that every process of every side replays the same bytes.

Conversations come from ``Workload.conversation`` in the order ``bench.index_memory.build``
applies them, until the same holder-block target; queries are ``queries(wl, tokens, n)`` on the
same workload afterwards, as ``bench.score_latency`` draws them. Format (little-endian):

    header: b"KVWPEER1", u32 block_size, u32 blocks_per_event, u32 events_per_record,
            u32 workers, u64 conversations, u64 holder_blocks, u64 blocks_stored,
            u32 queries, u32 query_tokens, u32 warmup
    conversations: u32 worker, u32 n, u64 engine_hashes[n], u32 tokens[n * block_size]
    queries: u32 tokens[query_tokens], one after another
    answers (each side's output): per query u32 count, then count x (u32 worker, u32 blocks),
            by worker

``src/main.rs`` reads the same format; a worker is its index in ``Workload.workers``.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..index_memory import BS, CONV_BLOCKS, EV_BLOCKS, N_SYS, N_WORKERS, SYS_BLOCKS, Workload
from ..score_latency import queries

MAGIC = b"KVWPEER1"
_HEAD = struct.Struct("<8s4I3Q3I")
EVENTS_PER_RECORD = 2  # bench.index_memory.build applies two events per apply_batch
WARMUP = 30  # queries each side scores before timing, as bench.score_latency warms


@dataclass(frozen=True)
class Header:
    block_size: int
    blocks_per_event: int
    events_per_record: int
    workers: int
    conversations: int
    holder_blocks: int
    blocks_stored: int
    queries: int
    query_tokens: int
    warmup: int


def write(path: Path, holder_blocks: int, n_queries: int, query_tokens: int = 8192, seed: int = 0) -> Header:
    """Dumps the workload up to ``holder_blocks`` holder-blocks (build's stopping rule)."""
    wl = Workload(seed)
    held: list[set[int]] = [set() for _ in range(N_WORKERS)]
    hb = stored = n_conv = 0
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"\0" * _HEAD.size)
        c = 0
        while hb < holder_blocks:
            for w in range(N_WORKERS):
                evs = wl.conversation(w, c)
                # The index counts a system prompt once per worker: a worker that stores it again
                # holds no new block (kvwire's side checks this count against len(index)).
                s = (w + c) % N_SYS
                hb += CONV_BLOCKS - (SYS_BLOCKS if s in held[w] else 0)
                held[w].add(s)
                hashes = np.array([h for e in evs for h in e.block_hashes], dtype="<u8")
                tokens = np.concatenate([np.frombuffer(e.token_ids, dtype=np.uint32) for e in evs]).astype("<u4")
                f.write(struct.pack("<2I", w, len(hashes)))
                f.write(hashes.tobytes())
                f.write(tokens.tobytes())
                stored += len(hashes)
                n_conv += 1
                if hb >= holder_blocks:
                    break
            c += 1
        for q in queries(wl, query_tokens, n_queries):
            f.write(np.asarray(q, dtype="<u4").tobytes())
        h = Header(BS, EV_BLOCKS, EVENTS_PER_RECORD, N_WORKERS, n_conv, hb, stored, n_queries, query_tokens, WARMUP)
        f.seek(0)
        f.write(_HEAD.pack(MAGIC, *(getattr(h, k) for k in Header.__dataclass_fields__)))
    tmp.replace(path)
    return h


class Dump:
    """Reads a dump in one pass: ``header``, then ``conversations()``, then ``queries()``."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")  # noqa: SIM115 (read across two generators)
        magic, *fields = _HEAD.unpack(self._f.read(_HEAD.size))
        if magic != MAGIC:
            raise ValueError(f"{path}: not a bench/peers dump")
        self.header = Header(*fields)

    def conversations(self) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """(worker, engine hashes uint64, tokens uint32) per conversation, in apply order."""
        bs = self.header.block_size
        for _ in range(self.header.conversations):
            w, n = struct.unpack("<2I", self._f.read(8))
            hashes = np.frombuffer(self._f.read(8 * n), dtype="<u8")
            tokens = np.frombuffer(self._f.read(4 * n * bs), dtype="<u4")
            yield w, hashes, tokens

    def queries(self) -> list[np.ndarray]:
        t = self.header.query_tokens
        return [np.frombuffer(self._f.read(4 * t), dtype="<u4").astype(np.uint32) for _ in range(self.header.queries)]

    def close(self) -> None:
        self._f.close()


def write_answers(path: Path, answers: list[list[tuple[int, int]]]) -> None:
    """Per query, (worker, matched blocks) pairs; sorted here so both sides' bytes compare."""
    with open(path, "wb") as f:
        for a in answers:
            a = sorted(a)
            f.write(struct.pack(f"<I{2 * len(a)}I", len(a), *(x for pair in a for x in pair)))


def read_answers(path: Path, n_queries: int) -> list[list[tuple[int, int]]]:
    b = Path(path).read_bytes()
    out, i = [], 0
    for _ in range(n_queries):
        (n,) = struct.unpack_from("<I", b, i)
        v = struct.unpack_from(f"<{2 * n}I", b, i + 4)
        out.append(list(zip(v[::2], v[1::2], strict=True)))
        i += 4 + 8 * n
    if i != len(b):
        raise ValueError(f"{path}: {len(b) - i} bytes after {n_queries} answers")
    return out
