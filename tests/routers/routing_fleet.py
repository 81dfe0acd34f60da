"""The fleet both router tests run: four engines (one of them TP 2), sixteen prompts whose pairs
share a system prompt, and a best holder per prompt, published through a real broker.

What a router must answer is computed from the engines' caches (``Fleet.longest``), never from
kvwire: a prompt is checked when exactly one worker holds its longest prefix."""

from __future__ import annotations

import random

from polling import wait_for
from stream_client import StreamClient
from streams_fleet import BS, Fleet, prompts, topic

from kvwire.schemas.events import WorkerId

E0, E1R0, E1R1, E2, E3 = (
    WorkerId("e0", 0, 0, 1),
    WorkerId("e1", 0, 0, 2),
    WorkerId("e1", 0, 1, 2),
    WorkerId("e2", 0, 0, 1),
    WorkerId("e3", 0, 0, 1),
)
RANKS = [E0, E1R0, E1R1, E2, E3]
WORKERS = [("e0", 0), ("e1", 0), ("e2", 0), ("e3", 0)]
N_PROMPTS = 16


def build(bootstrap: str, topic: str, seed: int = 7) -> Fleet:
    rng = random.Random(seed)
    fleet = Fleet(bootstrap, topic, prompts(N_PROMPTS), heartbeat_interval_s=0.5)
    for r in RANKS:
        fleet.rank(r)
    ranks_of = {"e0": [E0], "e1": [E1R0, E1R1], "e2": [E2], "e3": [E3]}
    for p in range(N_PROMPTS):
        best = WORKERS[p % 4][0]
        n = 4 + p % 5
        for r in ranks_of[best]:
            # e1's rank 0 holds more than rank 1: the worker holds what both do.
            fleet.store(r, p, 8 if r is E1R0 else n)
        for other in rng.sample([w for w, _ in WORKERS if w != best], 2):
            for r in ranks_of[other]:
                fleet.store(r, p, rng.randrange(1, n))
    # Evictions change some answers: the router must follow removals too.
    for p in (1, 6, 11):
        for r in ranks_of[WORKERS[p % 4][0]]:
            fleet.evict(r, p, 1)
    wait_for(fleet.delivered, "the fleet's records acked")
    return fleet


def expected(fleet: Fleet, alive: list[tuple[str, int]] | None = None) -> dict[int, tuple[str, int]]:
    """prompt -> the one worker holding its longest prefix, among ``alive`` (prompts with a tie
    at the top, or held by none, are left out)."""
    out = {}
    for p in range(N_PROMPTS):
        got = fleet.longest(RANKS, fleet.prompts[p])
        got = {w: n for w, n in got.items() if alive is None or w in alive}
        top = max(got.values(), default=0)
        best = [w for w, n in got.items() if n == top]
        if top > 0 and len(best) == 1:
            out[p] = best[0]
    return out


def churn(fleet: Fleet, rank: WorkerId, batches: int) -> None:
    """About ``batches`` records that each change what ``rank`` holds in a block no other record
    names (the member applies records in slices, and a stream sends what a slice changed, so
    records that undo each other within one slice would send nothing): one batch each. Each
    stores a fresh one-block sequence, then each is evicted again, so the end state is the start's."""
    rng = random.Random(batches)
    first = len(fleet.prompts)
    for i in range(batches):
        if i < batches // 2:
            fleet.prompts.append([rng.randrange(50_000) for _ in range(BS)])
            fleet.store(rank, first + i, 1)
        else:
            fleet.evict(rank, first + i - batches // 2, 0)
        if i % 2000 == 1999:
            wait_for(fleet.delivered, "the churn acked", timeout=120)
    wait_for(fleet.delivered, "the churn acked", timeout=120)


def stream_seq(entry: dict) -> int:
    """The next seq of a stream, as a subscriber learns it from the first batch it receives."""
    c = StreamClient(entry["endpoint"], entry["replay_endpoint"])
    try:
        wait_for(lambda: c.sub.poll(100), "a batch of the stream")
        _, seq, _ = c.sub.recv_multipart()
        return int.from_bytes(seq, "big")
    finally:
        c.close()


def stream_state(entry: dict) -> dict[str, set[int]]:
    """What a subscriber joining now learns of a stream: medium -> block hashes."""
    c = StreamClient(entry["endpoint"], entry["replay_endpoint"])
    try:
        wait_for(lambda: c.poll(100) and c.next_seq is not None, "a batch of the stream")
        assert c.violations == [], c.violations
        return c.state()
    finally:
        c.close()


def topic_sync(bootstrap: str):
    """``streams_fleet.topic`` for a synchronous test."""
    import asyncio
    import contextlib

    @contextlib.contextmanager
    def cm():
        agen = topic(bootstrap)
        name = asyncio.run(agen.__aenter__())
        try:
            yield name
        finally:
            asyncio.run(agen.__aexit__(None, None, None))

    return cm()


__all__ = ["BS", "RANKS", "WORKERS", "build", "churn", "expected", "stream_seq", "stream_state", "topic_sync"]
