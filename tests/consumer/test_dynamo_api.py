"""Dynamo's indexer API on an index member: tiers, models, TP, trust, the v1 hash, bounded input.

The real ``dynamo.indexer`` answering the same events is the judge in
tests/routers/test_dynamo_indexer.py; here a brute-force model of what each worker holds is.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwire.consumer.apply import Applier
from kvwire.consumer.dynamo_api import tier
from kvwire.consumer.http import make_app
from kvwire.consumer.keys import context_seed, prompt_keys, sequence_keys, xxh3_64
from kvwire.consumer.worker_ids import worker_id
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, EventBatch, WorkerId, stored

BS = 4
MEDIA = ("GPU", "CPU", "STORAGE", "NVME")


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def cumulative(held: dict[str, set[int]], tiers: tuple[str, ...] | None, n: int) -> int:
    """Oracle: the longest run of leading blocks each held on some medium of ``tiers``."""
    run = 0
    while run < n and any(run in b for m, b in held.items() if tiers is None or tier(m) in tiers):
        run += 1
    return run * BS


class Fleet:
    """Random per-medium holdings of a few workers, applied to an Applier and kept as sets."""

    def __init__(self, seed: int, prompt: list[int]) -> None:
        rng = random.Random(seed)
        self.applier = Applier()
        self.held: dict[tuple[str, int], dict[str, set[int]]] = {}
        self.prompt = prompt
        n = len(prompt) // BS
        for w in range(6):
            inst, dp = str(100 + w), w % 2
            held = self.held[(inst, dp)] = {}
            events = []
            for medium in rng.sample(MEDIA, rng.randint(1, 3)):
                k = rng.randint(0, n)
                # Stored as one chain; then some blocks removed (evictions leave holes).
                hashes = [hash((inst, dp, medium, i)) & (2**62 - 1) for i in range(k)]
                if k:
                    events.append(stored(hashes, prompt[: k * BS], BS, medium=medium))
                drop = {i for i in range(k) if rng.random() < 0.2}
                if drop:
                    events.append(BlockRemoved(tuple(hashes[i] for i in sorted(drop)), medium=medium))
                held[medium] = set(range(k)) - drop
            self.applier.apply_batch(EventBatch(WorkerId(inst, dp, 0, 1, "m"), 1, 0, 1, tuple(events), reset=True))

    def expected(self) -> dict[str, dict]:
        n = len(self.prompt) // BS
        out: dict[str, dict] = {}
        for (inst, dp), held in self.held.items():
            views = {
                "gpu": cumulative(held, ("device",), n),
                "cpu": cumulative(held, ("device", "host_pinned"), n),
                "disk": cumulative(held, ("device", "host_pinned", "disk"), n),
                "longest_matched": cumulative(held, None, n),
            }
            if views["longest_matched"] == 0:
                continue
            o = out.setdefault(str(worker_id(inst)), {"dp": {}})
            o["dp"][str(dp)] = views["gpu"]
            for k, v in views.items():
                o[k] = max(o.get(k, 0), v)
        return out


async def answer(app, path: str, body: dict) -> tuple[int, dict]:
    async with TestClient(TestServer(app)) as c:
        r = await c.post(path, json=body)
        return r.status, await r.json()


@pytest.mark.parametrize("seed", range(8))
async def test_query_tiers_are_cumulative_runs_as_the_oracle_says(seed):
    prompt = list(range(1000, 1000 + 10 * BS + 3))
    fleet = Fleet(seed, prompt)
    status, got = await answer(
        make_app(fleet.applier, lambda: True), "/query", {"token_ids": prompt, "model_name": "m"}
    )
    assert status == 200
    assert got["instances"] == fleet.expected()
    assert got["scores"] == {
        i: {d: t for d, t in o["dp"].items() if t > 0} for i, o in fleet.expected().items() if o["gpu"] > 0
    }
    assert got["frequencies"] == []


async def test_query_by_hash_is_query_given_dynamos_own_block_hashes():
    import dynamo.llm as dynamo_llm

    prompt = list(range(7, 7 + 9 * BS))
    fleet = Fleet(3, prompt)
    app = make_app(fleet.applier, lambda: True)
    hashes = dynamo_llm.compute_block_hash_for_seq(prompt, BS)
    # Dynamo's content hashes chain to kvwire's keys: the routers' v1 hash, checked on Dynamo itself.
    assert sequence_keys(hashes).tolist() == prompt_keys(prompt, BS).tolist()
    _, by_tokens = await answer(app, "/query", {"token_ids": prompt, "model_name": "m"})
    status, by_hash = await answer(
        app, "/query_by_hash", {"block_hashes": [signed(h) for h in hashes], "model_name": "m"}
    )
    assert status == 200 and by_hash == by_tokens and by_hash["instances"]
    status, err = await answer(app, "/query_by_hash", {"block_hashes": [max(hashes)], "model_name": "m"})
    assert status == 422 and "error" in err  # over 2^63 as u64: outside i64, as Dynamo refuses it


def test_content_hashes_equal_dynamos_with_and_without_lora():
    import dynamo.llm as dynamo_llm

    rng = random.Random(5)
    for lora in (None, "adapter-a"):
        tokens = [rng.randrange(2**32) for _ in range(6 * 16 + 5)]
        theirs = dynamo_llm.compute_block_hash_for_seq(tokens, 16, lora_name=lora)
        words = np.asarray(tokens, "<u4")
        ours = [xxh3_64(words[i * 16 : (i + 1) * 16].tobytes(), context_seed(lora)) for i in range(6)]
        assert ours == theirs
        assert sequence_keys(theirs).tolist() == prompt_keys(tokens, 16, lora).tolist()


async def test_model_name_selects_named_workers_and_unnamed_answer_every_model():
    a = Applier()
    prompt = list(range(3 * BS))
    for inst, model in (("1", "llama"), ("2", "qwen"), ("3", "")):
        a.apply_batch(EventBatch(WorkerId(inst, 0, 0, 1, model), 1, 0, 1, (stored([1, 2, 3], prompt, BS),), reset=True))
    app = make_app(a, lambda: True)
    _, got = await answer(app, "/query", {"token_ids": prompt, "model_name": "llama"})
    assert set(got["scores"]) == {"1", "3"}
    status, got = await answer(app, "/query", {"token_ids": prompt, "model_name": "mistral"})
    assert status == 200 and set(got["scores"]) == {"3"}
    b = Applier()
    b.apply_batch(EventBatch(WorkerId("1", 0, 0, 1, "llama"), 1, 0, 1, (stored([1], prompt[:BS], BS),), reset=True))
    status, got = await answer(make_app(b, lambda: True), "/query", {"token_ids": prompt, "model_name": "mistral"})
    assert status == 404 and "mistral" in got["error"]


async def test_tp_ranks_and_trust_decide_what_is_credited():
    a = Applier()
    prompt = list(range(4 * BS))
    # Worker 7 runs TP 2: rank 1 holds only the first two blocks.
    a.apply_batch(EventBatch(WorkerId("7", 0, 0, 2, "m"), 1, 0, 1, (stored([1, 2, 3, 4], prompt, BS),), reset=True))
    a.apply_batch(EventBatch(WorkerId("7", 0, 1, 2, "m"), 1, 0, 1, (stored([1, 2], prompt[: 2 * BS], BS),), reset=True))
    a.apply_batch(
        EventBatch(WorkerId("8", 0, 0, 1, "m"), 1, 0, 1, (stored([5, 6, 7], prompt[: 3 * BS], BS),), reset=True)
    )
    app = make_app(a, lambda: True)
    _, got = await answer(app, "/query", {"token_ids": prompt, "model_name": "m"})
    assert got["scores"] == {"7": {"0": 2 * BS}, "8": {"0": 3 * BS}}
    a.apply_batch(EventBatch(WorkerId("8", 0, 0, 1, "m"), 1, 1, 2, (), gap=3))  # 8 lost batches
    _, got = await answer(app, "/query", {"token_ids": prompt, "model_name": "m"})
    assert got["scores"] == {"7": {"0": 2 * BS}} and "8" not in got["instances"]
    a.apply_batch(EventBatch(WorkerId("8", 0, 0, 1, "m"), 1, 2, 3, (AllBlocksCleared(),)))
    _, got = await answer(app, "/query", {"token_ids": prompt, "model_name": "m"})
    assert "8" not in got["instances"]  # trusted again, and holding nothing


async def test_workers_listing_and_the_refusals():
    a = Applier()
    a.apply_batch(EventBatch(WorkerId("w-a", 1, 0, 1, "m"), 1, 0, 1, (stored([1], range(BS), BS),), reset=True))
    async with TestClient(TestServer(make_app(a, lambda: True, topic="kv.t", max_tokens=8))) as c:
        ws = await (await c.get("/workers")).json()
        assert ws == [
            {
                "instance_id": worker_id("w-a"),
                "source": "kafka",
                "status": "active",
                "model_name": "m",
                "routing_group": "default",
                "block_size": BS,
                "endpoints": {"1": "kafka://kv.t"},
                "listeners": {"1": {"endpoint": "kafka://kv.t", "status": "active"}},
            }
        ]
        r = await c.post(
            "/register", json={"instance_id": 1, "endpoint": "tcp://x:1", "model_name": "m", "block_size": 4}
        )
        assert r.status == 501 and "log" in (await r.json())["error"]
        r = await c.get("/dump")
        assert r.status == 404 and "--event-streams" in (await r.json())["error"]
        r = await c.post("/query", data=b"{", headers={"content-type": "application/json"})
        assert r.status == 400
        r = await c.post("/query", json={"token_ids": "bad", "model_name": "m"})
        assert r.status == 422
        r = await c.post("/query", json={"token_ids": list(range(9)), "model_name": "m"})
        assert r.status == 413


def test_a_snapshot_keeps_each_ranks_model_and_an_older_one_restores_none():
    import msgspec

    from kvwire.consumer.snapshot import RankRecord, SnapshotBody, capture, decode_snapshot, encode_snapshot, load

    a = Applier()
    a.apply_batch(EventBatch(WorkerId("5", 0, 0, 1, "llama"), 1, 0, 1, (stored([1], range(BS), BS),), reset=True))
    a.workers_by_partition[0] = {("5", 0)}
    body = decode_snapshot(encode_snapshot(capture(a, "t", 0)))
    b = Applier()
    load(b, body)
    assert [r.model for r in b.ranks.core.ranks()] == ["llama"]
    legacy = msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    legacy[4] = [r[: RankRecord.__struct_fields__.index("model")] for r in legacy[4]]
    c = Applier()
    load(c, msgspec.msgpack.decode(msgspec.msgpack.encode(legacy), type=SnapshotBody))
    assert [r.model for r in c.ranks.core.ranks()] == [""]
    # The rank's next record names its model again.
    c.apply_batch(EventBatch(WorkerId("5", 0, 0, 1, "llama"), 1, 1, 2, ()))
    assert [r.model for r in c.ranks.core.ranks()] == ["llama"]
