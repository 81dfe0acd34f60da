"""HTTP API contract: scores, workers, health, metrics, digest, and bounded input."""

from __future__ import annotations

import json

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwire.consumer.apply import Applier
from kvwire.consumer.http import make_app, merge_scores
from kvwire.schemas.events import EventBatch, WorkerId, stored


def applier_with_blocks() -> Applier:
    a = Applier()
    a.apply_batch(EventBatch(WorkerId("w1"), 1, 0, 1, (stored([11, 12], range(32), 16),), reset=True))
    a.apply_batch(EventBatch(WorkerId("w2", 1), 2, 0, 1, (stored([21], range(16), 16, medium="CPU"),), reset=True))
    return a


@pytest.fixture
async def client():
    ready = {"ok": False}
    app = make_app(applier_with_blocks(), lambda: ready["ok"], max_tokens=1000, max_body_bytes=64 * 1024)
    async with TestClient(TestServer(app)) as c:
        c.ready = ready
        yield c


async def test_score_orders_workers_best_first(client):
    r = await client.post("/v1/score", json={"token_ids": list(range(40)), "lora_name": None})
    assert r.status == 200
    scores = (await r.json())["scores"]
    assert [(s["instance_id"], s["dp_rank"], s["matched_tokens"]) for s in scores] == [("w1", 0, 32), ("w2", 1, 16)]
    assert scores[0]["by_medium"] == {"GPU": 32} and scores[1]["by_medium"] == {"CPU": 16}
    assert scores[0]["score"] > scores[1]["score"]


async def test_untrusted_worker_scores_nothing():
    a = applier_with_blocks()
    a.apply_batch(EventBatch(WorkerId("w1"), 1, 1, 2, (), gap=4))  # w1 lost 4 batches
    async with TestClient(TestServer(make_app(a, lambda: True))) as c:
        scores = (await (await c.post("/v1/score", json={"token_ids": list(range(40))})).json())["scores"]
        assert [s["instance_id"] for s in scores] == ["w2"]
        ws = {w["instance_id"]: w for w in (await (await c.get("/v1/workers")).json())["workers"]}
        assert ws["w1"]["trusted"] is False and "lost 4" in ws["w1"]["ranks"][0]["untrusted_reason"]


async def test_workers_health_metrics_digest(client):
    ws = (await (await client.get("/v1/workers")).json())["workers"]
    assert {(w["instance_id"], w["blocks"], w["trusted"]) for w in ws} == {("w1", 2, True), ("w2", 1, True)}
    assert (await client.get("/healthz")).status == 503
    client.ready["ok"] = True
    assert (await client.get("/healthz")).status == 200
    text = await (await client.get("/metrics")).text()
    assert "kvwire_records_applied_total 2.0" in text
    d = await (await client.get("/v1/digest")).json()
    assert d["holder_blocks"] == 3 and isinstance(d["digest"], str)


@pytest.mark.parametrize(
    "body,status",
    [
        ({"token_ids": list(range(1001))}, 413),
        ({"token_ids": [-1]}, 400),
        ({"token_ids": [2**32]}, 400),
        ({"token_ids": "abc"}, 400),
        ({"tokens": [1]}, 400),
        ({"token_ids": [1], "lora_name": 5}, 400),
        ([1, 2, 3], 400),
    ],
)
async def test_bad_requests_get_4xx(client, body, status):
    r = await client.post("/v1/score", json=body)
    assert r.status == status
    assert "error" in await r.json()


async def test_oversized_and_non_json_bodies(client):
    r = await client.post("/v1/score", data=b"[" + b"1," * 40000 + b"1]", headers={"content-type": "application/json"})
    assert r.status == 413
    r = await client.post("/v1/score", data=b"\xff\x00not json")
    assert r.status == 400


def test_merge_keeps_the_better_answer_per_worker():
    a = [{"instance_id": "x", "dp_rank": 0, "matched_tokens": 16, "score": 16.0}]
    b = [
        {"instance_id": "x", "dp_rank": 0, "matched_tokens": 32, "score": 32.0},
        {"instance_id": "y", "dp_rank": 0, "matched_tokens": 48, "score": 38.4},
    ]
    assert [(s["instance_id"], s["matched_tokens"]) for s in merge_scores([a, b], 10)] == [("y", 48), ("x", 32)]
    assert json.dumps(merge_scores([a, b], 1))


async def test_block_hashes_form_answers_as_the_tokens_do():
    """The routers' v1 content hashes (Dynamo's own function computes them here) score as the tokens."""
    import dynamo.llm as dynamo_llm

    a = Applier()
    prompt = list(range(100, 100 + 5 * 16))
    a.apply_batch(EventBatch(WorkerId("w1"), 1, 0, 1, (stored([1, 2, 3], prompt[:48], 16),), reset=True))
    a.apply_batch(EventBatch(WorkerId("w2"), 1, 0, 1, (stored([4, 5], prompt[:32], 16, lora_name="ad"),), reset=True))
    hashes = dynamo_llm.compute_block_hash_for_seq(prompt, 16)
    signed = [h - (1 << 64) if h >= 1 << 63 else h for h in hashes]
    async with TestClient(TestServer(make_app(a, lambda: True))) as c:
        by_tokens = await (await c.post("/v1/score", json={"token_ids": prompt})).json()
        for form in (hashes, signed):
            r = await c.post("/v1/score", json={"block_hashes": form, "block_size": 16})
            assert r.status == 200 and await r.json() == by_tokens
        assert [s["instance_id"] for s in by_tokens["scores"]] == ["w1"]
        lora = dynamo_llm.compute_block_hash_for_seq(prompt, 16, lora_name="ad")
        got = await (await c.post("/v1/score", json={"block_hashes": lora})).json()
        assert [(s["instance_id"], s["matched_tokens"]) for s in got["scores"]] == [("w2", 32)]
        for bad in (
            {"block_hashes": hashes, "token_ids": prompt},
            {"block_hashes": hashes, "lora_name": "ad"},
            {"block_hashes": hashes, "cache_salt": "s"},
            {"block_hashes": [1 << 64]},
            {"block_hashes": [-(1 << 63) - 1]},
        ):
            assert (await c.post("/v1/score", json=bad)).status == 400, bad


async def test_block_hashes_scatter_to_peers_and_merge():
    """A member asks its peer (holding other workers) with the hashes and merges both answers."""
    from kvwire.consumer.keys import context_seed, xxh3_64

    prompt = list(range(300, 300 + 3 * 16))
    near, far = Applier(), Applier()
    near.apply_batch(EventBatch(WorkerId("near"), 1, 0, 1, (stored([1, 2], prompt[:32], 16),), reset=True))
    far.apply_batch(EventBatch(WorkerId("far"), 1, 0, 1, (stored([1, 2, 3], prompt, 16),), reset=True))
    words = np.asarray(prompt, "<u4")
    hashes = [xxh3_64(words[i * 16 : (i + 1) * 16].tobytes(), context_seed(None)) for i in range(3)]
    async with TestClient(TestServer(make_app(far, lambda: True))) as peer:
        front = make_app(near, lambda: True, peers=[str(peer.make_url(""))])
        async with TestClient(TestServer(front)) as c:
            body = await (await c.post("/v1/score", json={"block_hashes": hashes})).json()
    assert body["partial"] is False
    assert [(s["instance_id"], s["matched_tokens"]) for s in body["scores"]] == [("far", 48), ("near", 32)]


async def test_http_workers_that_cannot_listen_raise_the_oserror_and_clean_up():
    """A worker thread that cannot bind closes its own loop; `cleanup` afterwards must not try
    to stop that closed loop (it raised "Event loop is closed", a traceback where `kvwire
    index` owes one line: tests/cli/test_unreachable.py)."""
    import asyncio
    import socket

    from aiohttp import web

    from kvwire.consumer.http import HttpWorkers

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        workers = HttpWorkers(web.Application, "127.0.0.1", taken.getsockname()[1], 2, on_caller_loop=False)
        with pytest.raises(OSError):
            await workers.start()
        await asyncio.sleep(0.05)  # the failed thread has closed its loop by now
        await workers.cleanup()
    assert workers._threads == []
