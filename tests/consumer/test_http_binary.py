"""POST /v1/score with a binary body (little-endian uint32 token ids, the other fields as query
parameters): the same answers as the JSON form on a populated index, both equal to the oracle;
bounded and typed like the JSON form; and several HTTP workers (threads, one SO_REUSEPORT port)
serving the one index."""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from scoring_workload import fed, oracle_json, queries, records

from kvwire.consumer.http import HttpWorkers, make_app

BIN = {"content-type": "application/octet-stream"}


def le(tokens) -> bytes:
    return np.asarray(tokens, "<u4").tobytes()


@pytest.fixture(scope="module")
def populated():
    return fed(records())


@pytest.fixture
async def client(populated):
    app = make_app(populated[0], lambda: True, max_tokens=1000, max_body_bytes=64 * 1024)
    async with TestClient(TestServer(app)) as c:
        yield c


async def test_binary_and_json_bodies_answer_the_same_and_equal_the_oracle(client, populated):
    _, oracle = populated
    for top_k in (64, 2):
        for tokens, lora, bs in queries():
            body = {"token_ids": tokens, "lora_name": lora, "block_size": bs, "limit": top_k}
            rj = await client.post("/v1/score", json=body)
            params = {"top_k": str(top_k)}
            if lora is not None:
                params["lora_name"] = lora
            if bs is not None:
                params["block_size"] = str(bs)
            rb = await client.post("/v1/score", data=le(tokens), params=params, headers=BIN)
            assert rj.status == rb.status == 200
            jb, bb = await rj.read(), await rb.read()
            assert jb == bb
            assert json.loads(bb)["scores"] == oracle_json(oracle, tokens, lora, bs, top_k)


async def test_json_top_k_is_limit(client):
    tokens = queries()[0][0]
    a = await (await client.post("/v1/score", json={"token_ids": tokens, "limit": 1})).read()
    b = await (await client.post("/v1/score", json={"token_ids": tokens, "top_k": 1, "limit": 5})).read()
    assert a == b and len(json.loads(a)["scores"]) == 1


@pytest.mark.parametrize(
    "body,params,status,why",
    [
        (b"\x01\x00\x00", {}, 400, "not whole uint32"),
        (le(range(1001)), {}, 413, "at most 1000"),
        (le([1]), {"top_k": "0"}, 400, "top_k"),
        (le([1]), {"top_k": "x"}, 400, "top_k"),
        (le([1]), {"block_size": "0"}, 400, "block_size"),
        (le([1]), {"local": "maybe"}, 400, "local"),
        (le([1]), {"tokens": "1"}, 400, "unknown query parameter"),
    ],
)
async def test_bad_binary_requests_get_a_clear_4xx(client, body, params, status, why):
    r = await client.post("/v1/score", data=body, params=params, headers=BIN)
    assert r.status == status
    assert why in (await r.json())["error"]


async def test_empty_binary_body_is_an_empty_prompt(client):
    r = await client.post("/v1/score", data=b"", headers=BIN)
    assert r.status == 200 and (await r.json())["scores"] == []


async def test_peers_are_asked_in_binary_and_merged(populated):
    """A member with a peer scatters the binary form (local=true) and merges: with the peer
    holding the same index the merged answer is the local one."""
    applier, oracle = populated
    async with TestClient(TestServer(make_app(applier, lambda: True))) as peer:
        front = make_app(applier, lambda: True, peers=[str(peer.make_url(""))])
        async with TestClient(TestServer(front)) as c:
            tokens, lora, _ = queries()[3]
            r = await c.post("/v1/score", data=le(tokens), params={"lora_name": lora or ""}, headers=BIN)
            body = await r.json()
            assert body["partial"] is False and body["failed_peers"] == []
            # lora_name="" is a name, not None: the oracle scores the same name.
            assert body["scores"] == oracle_json(oracle, tokens, "", None)


async def test_http_workers_share_one_port_and_one_index(populated):
    applier, oracle = populated
    workers = HttpWorkers(lambda: make_app(applier, lambda: True), "127.0.0.1", 0, 3)
    port = await workers.start()
    try:
        qs = queries()
        expected = [oracle_json(oracle, t, lora, bs) for t, lora, bs in qs]

        async def one(i: int) -> None:
            # A connection per request, so the kernel spreads them over the listening sockets.
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
                t, lora, bs = qs[i % len(qs)]
                params = {k: str(v) for k, v in (("lora_name", lora), ("block_size", bs)) if v is not None}
                async with s.post(f"http://127.0.0.1:{port}/v1/score", data=le(t), params=params, headers=BIN) as r:
                    assert r.status == 200
                    assert (await r.json())["scores"] == expected[i % len(qs)]

        await asyncio.gather(*(one(i) for i in range(60)))
        threads = list(workers._threads)
        assert len(threads) == 2 and all(t.is_alive() for t, _ in threads)
    finally:
        await workers.cleanup()
    assert all(not t.is_alive() for t, _ in threads)


async def test_http_workers_on_threads_only_read_ingest_state_on_its_loop(populated):
    """As `kvwire index` serves: every HTTP loop is a thread, and what reads Python-side ingest
    state (/healthz, /v1/workers, /v1/digest) runs on the caller's (ingest's) loop."""
    applier, oracle = populated
    home = asyncio.get_running_loop()
    callers: list[int] = []

    def ready() -> bool:
        callers.append(threading.get_ident())
        return True

    workers = HttpWorkers(lambda: make_app(applier, ready, home=home), "127.0.0.1", 0, 2, on_caller_loop=False)
    port = await workers.start()
    threads = list(workers._threads)
    try:
        assert len(threads) == 2 and port != 0
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            for _ in range(4):
                async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                    assert r.status == 200
                async with s.get(f"http://127.0.0.1:{port}/v1/workers") as r:
                    assert {w["instance_id"] for w in (await r.json())["workers"]} == {"a", "b", "c", "d", "e"}
                async with s.get(f"http://127.0.0.1:{port}/v1/digest") as r:
                    assert (await r.json())["digest"] == applier.index.digest()
            t, lora, bs = queries()[0]
            async with s.post(f"http://127.0.0.1:{port}/v1/score", data=le(t), headers=BIN) as r:
                assert (await r.json())["scores"] == oracle_json(oracle, t, lora, bs)
    finally:
        await workers.cleanup()
    assert callers and set(callers) == {threading.get_ident()}
    assert all(not t.is_alive() for t, _ in threads)
