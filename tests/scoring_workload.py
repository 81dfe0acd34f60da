"""A deterministic fleet's records, fed to the real Applier and to the brute-force oracle.

Shared by the scoring-surface tests (HTTP JSON vs binary bodies, the in-process API, scores
under concurrent apply): every answer they check is compared with ``tests/oracle.py`` over
the same records. Workers: tp 1 and tp 2 (ranks reporting in separate records), GPU and CPU
media, block sizes 16 and 32, a LoRA adapter, removals and a clear."""

from __future__ import annotations

import random

from oracle import Oracle

from kvwire.consumer.apply import Applier
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

RANKS = [
    WorkerId("a", 0, 0, 1),
    WorkerId("b", 0, 0, 2),
    WorkerId("b", 0, 1, 2),
    WorkerId("c", 1, 0, 1),
    WorkerId("d", 0, 0, 1),
    WorkerId("e", 2, 0, 1),
]
PROMPTS = [[(31 * p + 7 * i) % 50_021 for i in range(512)] for p in range(4)]


def records(n: int = 80, seed: int = 5) -> list[EventBatch]:
    """``n`` records in log order; each rank's first is a reset (epoch 1, seq from 0)."""
    rng = random.Random(seed)
    seq: dict[WorkerId, int] = {}
    held: dict[WorkerId, list[tuple[str, int]]] = {}
    out = []
    for _ in range(n):
        rank = rng.choice(RANKS)
        p, bs = rng.randrange(len(PROMPTS)), rng.choice([16, 16, 32])
        medium = rng.choice(["GPU", "GPU", "CPU"])
        lora = "ad1" if p == 3 else None
        nb = rng.randrange(1, len(PROMPTS[p]) // bs)
        hashes = [hash((p, bs, lora, i)) & (2**64 - 1) for i in range(nb)]
        r = rng.random()
        if r < 0.15 and held.get(rank):
            gone = rng.sample(held[rank], k=min(3, len(held[rank])))
            for g in gone:
                held[rank].remove(g)
            ev: tuple = tuple(
                BlockRemoved((h,), medium=m) for m, h in gone
            )  # one removal per medium/hash, some unknown to the index
        elif r < 0.18:
            held[rank] = []
            ev = (AllBlocksCleared(),)
        else:
            ev = (stored(hashes, PROMPTS[p][: nb * bs], bs, medium=medium, lora_name=lora),)
            held.setdefault(rank, []).extend((medium, h) for h in hashes)
        s = seq.get(rank, -1) + 1
        seq[rank] = s
        out.append(EventBatch(rank, 1, s, 1_000 + len(out), ev, reset=s == 0))
    return out


def queries() -> list[tuple[list[int], str | None, int | None]]:
    """(tokens, lora_name, block_size): hits of every prompt at several lengths, a miss."""
    qs: list[tuple[list[int], str | None, int | None]] = []
    for p, toks in enumerate(PROMPTS):
        lora = "ad1" if p == 3 else None
        qs += [(toks, lora, None), (toks[:200], lora, None), (toks[:96] + [1, 2, 3] * 40, lora, 16)]
    qs.append(([9] * 300, None, None))
    return qs


def fed(recs: list[EventBatch]) -> tuple[Applier, Oracle]:
    a, o = Applier(), Oracle()
    for b in recs:
        a.apply_batch(b)
        o.apply_batch(b.worker, b.events if not b.reset else (AllBlocksCleared(), *b.events))
    return a, o


def oracle_json(o: Oracle, tokens: list[int], lora: str | None, bs: int | None, top_k: int = 64) -> list[dict]:
    """The oracle's answer in /v1/score's form (every worker is trusted here)."""
    return [
        {
            "instance_id": s.instance_id,
            "dp_rank": s.dp_rank,
            "matched_tokens": s.matched_tokens,
            "by_medium": dict(s.by_medium),
            "score": s.score,
        }
        for s in o.score(tokens, lora_name=lora, block_size=bs)
    ][:top_k]
