"""Speculative holds (kvwire.consumer.holds) over a real Applier/PrefixIndex: prefix credit,
expiry, confirmation by the worker's own BlockStored, the route pick and its tie-break, the
score answers with and without holds, and that holds never become index state.

Time is a hand-moved clock in the unit tests (expiry is checked against it, not waited for);
the burst and TTL tests at the end run a real broker, the normal producer and a real index
member on the wall clock."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwire.consumer.apply import Applier
from kvwire.consumer.holds import HeldScore, Holds, NoCandidate, trusted_workers, with_speculation
from kvwire.consumer.http import HttpWorkers, make_app
from kvwire.consumer.ingest import IndexMember, IngestConfig
from kvwire.consumer.router import Scorer
from kvwire.producer.config import PublisherConfig
from kvwire.producer.publisher import KafkaPublisher
from kvwire.schemas.events import EventBatch, WorkerId, stored

BS = 16
W = [("w0", 0), ("w1", 0), ("w2", 0)]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fleet(seed: int = 0) -> Applier:
    """Three trusted workers, each holding an unrelated prompt (the index knows BS)."""
    a = Applier()
    rng = random.Random(seed)
    for i, (inst, dp) in enumerate(W):
        toks = [rng.randrange(50_000, 60_000) for _ in range(2 * BS)]
        a.apply_batch(
            EventBatch(WorkerId(inst, dp), 1, 0, 1, (stored([100 * i + 1, 100 * i + 2], toks, BS),), reset=True)
        )
    return a


def store(a: Applier, worker: tuple[str, int], seq: int, tokens: list[int], **kw) -> None:
    n = len(tokens) // BS
    hashes = [hash((worker, seq, j)) & 0xFFFF_FFFF for j in range(n)]
    ev = stored(hashes, tokens[: n * BS], BS, **kw)
    a.apply_batch(EventBatch(WorkerId(*worker), 1, seq, seq + 1, (ev,)))


def prompt(seed: int, blocks: int = 4, tail: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30_000) for _ in range(blocks * BS + tail)]


def scorer(ttl: float = 2.0, **kw) -> tuple[Scorer, Clock]:
    clock = Clock()
    return Scorer(fleet(), Holds(ttl, clock=clock, **kw)), clock


def test_route_records_a_hold_that_credits_shared_leading_blocks_only():
    s, _ = scorer()
    p = prompt(1)
    r = s.route(p)
    assert r.worker == W[0] and r.matched_tokens == 0 and r.speculative_tokens == 0
    assert r.hold_expires_in_ms == 2000
    # The same prompt, a longer one, one sharing two blocks, one sharing none.
    longer = p[: 4 * BS] + prompt(2, 2)
    forked = p[: 2 * BS] + prompt(3, 2)
    cases = [(p, 4 * BS), (longer, 4 * BS), (forked, 2 * BS), (prompt(4), 0), (p[: BS - 1], 0)]
    for q, want in cases:
        got = {(x.instance_id, x.dp_rank): x for x in s.score(q)}
        if want:
            assert isinstance(got[W[0]], HeldScore)
            assert got[W[0]].speculative_tokens == want and got[W[0]].matched_tokens == 0
        else:
            assert W[0] not in got
    # Another tenant's prompt with the same tokens never gets the hold's credit.
    assert s.score(p, cache_salt="other") == []
    assert s.score(p, lora_name="adapter") == []
    assert s.score(p, extra_keys=[["mm", 0]]) == []


def test_a_hold_expires_after_its_ttl_and_holds_off_records_none():
    s, clock = scorer(ttl=2.0)
    p = prompt(5)
    s.route(p)
    assert len(s.holds) == 1 and s.score(p)[0].speculative_tokens == 4 * BS
    clock.t += 1.9
    assert s.score(p)[0].speculative_tokens == 4 * BS
    clock.t += 0.2
    assert s.score(p) == [] and len(s.holds) == 0 and s.holds.expired == 1
    off, _ = scorer(ttl=0.0)
    r = off.route(p)
    assert r.hold_expires_in_ms is None and len(off.holds) == 0 and off.score(p) == []


def test_the_workers_own_block_stored_confirms_and_ends_the_hold():
    s, _ = scorer()
    p = prompt(6)
    w = s.route(p).worker
    store(s.applier, w, 1, p[: 2 * BS])  # half the prompt: not yet covered
    got = s.score(p)[0]
    assert (got.matched_tokens, got.speculative_tokens) == (2 * BS, 4 * BS)
    assert len(s.holds) == 1
    store(s.applier, W[1], 1, p)  # another worker storing it confirms nothing of w's hold
    s.score(p)
    assert len(s.holds) == 1
    store(s.applier, w, 2, p)  # the whole prompt: the next call confirms the hold
    got = {(x.instance_id, x.dp_rank): x for x in s.score(p)}
    assert len(s.holds) == 0 and s.holds.confirmed == 1
    assert got[w].matched_tokens == 4 * BS and got[w].speculative_tokens == 0


def test_confirmation_checks_are_bounded_per_call():
    s, _ = scorer(checks_per_call=2)
    prompts = [prompt(100 + i) for i in range(6)]
    for p in prompts:
        s.holds.add(W[0], p, sizes=[BS])
    for i, p in enumerate(prompts):
        store(s.applier, W[0], i + 1, p)
    s.score(prompt(99))
    assert len(s.holds) == 4  # two checked
    s.score(prompt(99))
    s.score(prompt(99))
    assert len(s.holds) == 0 and s.holds.confirmed == 6


def test_route_tie_break_effective_then_score_then_load_then_name():
    s, _ = scorer(ttl=0.0)  # no holds: the load rule spreads a burst
    p = prompt(7)
    assert [s.route(p).worker for _ in range(6)] == [W[0], W[1], W[2], W[0], W[1], W[2]]
    s2, _ = scorer(ttl=2.0)
    # Confirmed prefix beats everything; between equal prefixes, the better medium's score wins.
    store(s2.applier, W[2], 1, p[: 2 * BS])
    r = s2.route(p)
    assert r.worker == W[2] and r.matched_tokens == 2 * BS
    s3, _ = scorer(ttl=2.0)
    s3.applier.apply_batch(EventBatch(WorkerId("w1"), 1, 1, 2, (stored([7001, 7002], p[: 2 * BS], BS, medium="CPU"),)))
    s3.applier.apply_batch(EventBatch(WorkerId("w2"), 1, 1, 2, (stored([7003, 7004], p[: 2 * BS], BS),)))
    r = s3.route(p)
    assert r.worker == W[2] and [x.worker for x in r.rows] == [W[2], W[1], W[0]]
    # A hold's speculative credit beats a shorter confirmed prefix elsewhere.
    r2 = s3.route(p)
    assert r2.worker == W[2] and r2.speculative_tokens == 4 * BS and r2.matched_tokens == 2 * BS


def test_candidates_restrict_the_pick_and_none_known_is_no_candidate():
    s, _ = scorer()
    p = prompt(8)
    assert s.route(p, candidates=[("w2", 0), ("w1", 0)]).worker == W[1]
    assert s.route(p, candidates=[("w2", 0)]).worker == W[2]
    with pytest.raises(NoCandidate):
        Scorer(Applier(), Holds(clock=Clock())).route(p)
    # An untrusted worker is no default candidate.
    a = fleet()
    a.apply_batch(EventBatch(WorkerId("w0"), 1, 1, 2, (), gap=3))
    assert Scorer(a, Holds(clock=Clock())).route(p).worker == W[1]


def test_holds_never_reach_index_state():
    s, _ = scorer()
    before = (s.applier.index.digest(), len(s.applier.index), s.applier.workers())
    for i in range(5):
        s.route(prompt(200 + i))
    assert len(s.holds) == 5
    assert (s.applier.index.digest(), len(s.applier.index), s.applier.workers()) == before


def test_without_live_holds_scores_are_byte_identical():
    s, clock = scorer()
    p = prompt(9)
    store(s.applier, W[1], 1, p)
    plain = s.applier.score_json(p, None, None, 64)
    assert s.score_json(p) == plain
    s.route(prompt(10))  # a live hold on another prompt: the answer changes shape
    with_hold = json.loads(s.score_json(p))
    assert [x["speculative_tokens"] for x in with_hold] == [0]
    clock.t += 5
    assert s.score_json(p) == plain


def test_with_speculation_orders_by_effective_credit():
    conf = [
        {"instance_id": "a", "dp_rank": 0, "matched_tokens": 32, "by_medium": {"GPU": 32}, "score": 32.0},
        {"instance_id": "b", "dp_rank": 0, "matched_tokens": 16, "by_medium": {"GPU": 16}, "score": 16.0},
    ]
    out = with_speculation(conf, {("c", 0): 48, ("b", 0): 16}, 10)
    assert [(x["instance_id"], x["matched_tokens"], x["speculative_tokens"]) for x in out] == [
        ("c", 0, 48),
        ("a", 32, 0),
        ("b", 16, 16),
    ]
    assert with_speculation(conf, {("c", 0): 48}, 1)[0]["instance_id"] == "c"


def test_holds_compare_in_the_index_block_sizes_or_the_default():
    h = Holds(clock=Clock())
    p = prompt(11)
    h.add(("x", 0), p, sizes=[32])
    assert h.credit(p, sizes=[32]) == {("x", 0): 64}
    assert h.credit(p, sizes=[16]) == {}  # a size the hold was not recorded in
    s = Scorer(Applier(), Holds(clock=Clock()))
    r = s.route(p, candidates=[("x", 0)])  # empty index: vLLM's default block size
    assert r.hold_expires_in_ms is not None
    assert [(x.instance_id, x.speculative_tokens) for x in s.score(p)] == []  # x is not a trusted worker
    assert s.holds.credit(p, sizes=[16]) == {("x", 0): 4 * BS}


def test_routing_again_restarts_a_hold_instead_of_adding_one():
    s, clock = scorer()
    p = prompt(12)
    s.route(p)
    clock.t += 1.5
    s.route(p)
    assert len(s.holds) == 1
    clock.t += 1.0  # past the first hold's TTL, within the second's
    assert s.score(p)[0].speculative_tokens == 4 * BS


def test_max_holds_drops_the_oldest():
    h = Holds(clock=Clock(), max_holds=3)
    for i in range(5):
        h.add(("x", 0), prompt(300 + i), sizes=[BS])
    assert len(h) == 3
    assert h.credit(prompt(300), sizes=[BS]) == {} and h.credit(prompt(304), sizes=[BS]) == {("x", 0): 4 * BS}


# ------------------------------------------------------------------ HTTP


@pytest.fixture
async def client():
    clock = Clock()
    app = make_app(fleet(), lambda: True, max_tokens=1000, max_body_bytes=64 * 1024, holds=Holds(2.0, clock=clock))
    async with TestClient(TestServer(app)) as c:
        c.clock = clock
        yield c


async def test_http_route_and_score_show_the_hold(client):
    p = prompt(13)
    plain = await (await client.post("/v1/score", json={"token_ids": p})).read()
    r = await client.post("/v1/route", json={"token_ids": p})
    assert r.status == 200
    body = await r.json()
    assert body["worker"] == {"instance_id": "w0", "dp_rank": 0}
    assert body["matched_tokens"] == 0 and body["speculative_tokens"] == 0 and body["hold"] == {"expires_in_ms": 2000}
    assert [(x["instance_id"], x["speculative_tokens"]) for x in body["scores"]] == [("w0", 0), ("w1", 0), ("w2", 0)]
    r2 = await (await client.post("/v1/route", json={"token_ids": p})).json()
    assert r2["worker"]["instance_id"] == "w0" and r2["speculative_tokens"] == 4 * BS and r2["matched_tokens"] == 0
    scores = (await (await client.post("/v1/score", json={"token_ids": p})).json())["scores"]
    assert scores == [
        {
            "instance_id": "w0",
            "dp_rank": 0,
            "matched_tokens": 0,
            "by_medium": {},
            "score": 0.0,
            "speculative_tokens": 64,
        }
    ]
    client.clock.t += 3
    assert await (await client.post("/v1/score", json={"token_ids": p})).read() == plain


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


async def test_holds_and_route_latency_are_exported(client):
    p = prompt(13)
    await client.post("/v1/route", json={"token_ids": p})
    await client.post("/v1/route", json={"token_ids": prompt(14)})
    text = await (await client.get("/metrics")).text()
    assert _metric(text, "kvwire_holds_live") == 2
    assert _metric(text, "kvwire_holds_made_total") == 2
    assert _metric(text, 'kvwire_route_latency_seconds_count{scope="local"}') == 2
    client.clock.t += 3
    text = await (await client.get("/metrics")).text()
    assert _metric(text, "kvwire_holds_live") == 0
    assert _metric(text, 'kvwire_holds_ended_total{why="expired"}') == 2
    assert _metric(text, 'kvwire_holds_ended_total{why="confirmed"}') == 0


@pytest.mark.parametrize(
    "body,status",
    [
        ({"token_ids": list(range(1001))}, 413),
        ({"token_ids": [-1]}, 400),
        ({"token_ids": [1], "candidates": []}, 400),
        ({"token_ids": [1], "candidates": [{"instance_id": "w0", "dp_rank": -1}]}, 400),
        ({"token_ids": [1], "candidates": [{"dp_rank": 0}]}, 400),
        ({"token_ids": [1], "cache_salt": 5}, 400),
        ({"token_ids": [1], "extra_keys": [{"a": 1}]}, 400),
        ({"token_ids": [1], "extra_keys": [[1], [2]]}, 400),
        ({"token_ids": [1], "nope": 1}, 400),
        ([1], 400),
    ],
)
async def test_http_route_bad_requests_get_4xx(client, body, status):
    r = await client.post("/v1/route", json=body)
    assert r.status == status
    assert "error" in await r.json()


async def test_http_route_without_any_worker_is_503():
    async with TestClient(TestServer(make_app(Applier(), lambda: True))) as c:
        r = await c.post("/v1/route", json={"token_ids": list(range(40))})
        assert r.status == 503 and "no candidate" in (await r.json())["error"]


async def test_http_route_oversized_and_non_json(client):
    r = await client.post("/v1/route", data=b"x" * (65 * 1024))
    assert r.status == 413
    r = await client.post("/v1/route", data=b"{not json")
    assert r.status == 400 and "invalid JSON" in (await r.json())["error"]


async def test_peers_answer_without_their_holds_and_the_front_adds_its_own():
    """In a group of members, a peer asked with local=true answers index state only; the member
    the request reached routes on the merged confirmed answer and adds its own holds."""
    peer_applier = fleet()
    p = prompt(14)
    store(peer_applier, W[2], 1, p[: 2 * BS])  # w2's blocks live in the peer's partitions
    peer_holds = Holds(2.0, clock=Clock())
    async with TestClient(TestServer(make_app(peer_applier, lambda: True, holds=peer_holds))) as peer:
        await peer.post("/v1/route", json={"token_ids": prompt(15)})  # a hold of the peer's own
        assert len(peer_holds) == 1
        front_holds = Holds(2.0, clock=Clock())
        front = make_app(Applier(), lambda: True, peers=[str(peer.make_url(""))], holds=front_holds)
        async with TestClient(TestServer(front)) as c:
            r = await (await c.post("/v1/route", json={"token_ids": p})).json()
            assert r["worker"] == {"instance_id": "w2", "dp_rank": 0} and r["matched_tokens"] == 2 * BS
            assert r["partial"] is False and len(front_holds) == 1
            body = await (await c.post("/v1/score", json={"token_ids": p})).json()
            assert [(x["instance_id"], x["matched_tokens"], x["speculative_tokens"]) for x in body["scores"]] == [
                ("w2", 2 * BS, 4 * BS)
            ]
            # The peer's hold (another prompt) never shows through the scatter.
            body = await (await c.post("/v1/score", json={"token_ids": prompt(15)})).json()
            assert all("speculative_tokens" not in x or x["speculative_tokens"] == 0 for x in body["scores"])
            assert body["scores"] == []


# ------------------------------------------------------------------ the burst, through a real broker


async def _wait(cond, what: str, timeout: float = 60.0) -> None:
    """Poll a condition; the limit only bounds a hang, it asserts no speed."""
    for _ in range(int(timeout / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Fleet:
    """Three workers publishing through the normal producer; one index member (real ingest)
    served the way ``kvwire index`` serves it: HTTP loops on threads, one shared ``Holds``."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.pub = KafkaPublisher(
            PublisherConfig(bootstrap_servers=bootstrap, topic=topic, linger_ms=1, heartbeat_interval_s=0.5)
        )
        self.streams = {w: self.pub.stream(WorkerId(w[0], w[1], 0, 1, "m"), source="test") for w in W}
        self.member = IndexMember(IngestConfig(bootstrap, topic))
        self.servers: list[HttpWorkers] = []
        self._hashes = 0

    def store(self, worker: tuple[str, int], tokens: list[int]) -> None:
        n = len(tokens) // BS
        self._hashes += n
        hashes = [hash((worker, self._hashes, j)) & 0xFFFF_FFFF for j in range(n)]
        assert self.streams[worker].publish([stored(hashes, tokens[: n * BS], BS)])

    async def serve(self, holds: Holds) -> str:
        loop = asyncio.get_running_loop()
        m = self.member
        http = HttpWorkers(
            lambda: make_app(m.applier, lambda: m.ready, home=loop, holds=holds),
            "127.0.0.1",
            0,
            2,
            on_caller_loop=False,
        )
        self.servers.append(http)
        return f"http://127.0.0.1:{await http.start()}"

    async def close(self) -> None:
        for s in self.servers:
            await s.cleanup()
        await self.member.stop()
        await asyncio.to_thread(self.pub.close)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json()


@pytest.mark.integration
async def test_a_burst_inside_the_lag_window_lands_on_one_worker(kafka_bootstrap, new_topic):
    fleet = Fleet(kafka_bootstrap, new_topic(partitions=3))
    await fleet.member.start()
    try:
        for i, w in enumerate(W):  # a fleet in service: unrelated prompts cached, every worker trusted
            fleet.store(w, prompt(400 + i))
        a = fleet.member.applier
        await _wait(lambda: len(a.index) == 3 * 4 and len(trusted_workers(a)) == 3, "the fleet's blocks")
        held, off = Holds(30.0), Holds(0.0)  # 30 s: the burst's holds must outlive a loaded machine
        url_held, url_off = await fleet.serve(held), await fleet.serve(off)
        p = prompt(500)
        before = (a.index.digest(), len(a.index), a.index.export_workers(W))
        async with aiohttp.ClientSession() as s:
            burst = await asyncio.gather(*(_post(s, f"{url_held}/v1/route", {"token_ids": p}) for _ in range(8)))
            chosen = {(r["worker"]["instance_id"], r["worker"]["dp_rank"]) for r in burst}
            assert len(chosen) == 1, chosen
            assert all(r["matched_tokens"] == 0 for r in burst)
            assert sorted(r["speculative_tokens"] for r in burst) == [0] + [4 * BS] * 7
            spread = await asyncio.gather(*(_post(s, f"{url_off}/v1/route", {"token_ids": p}) for _ in range(8)))
            assert len({(r["worker"]["instance_id"], r["worker"]["dp_rank"]) for r in spread}) > 1
            assert all(r["hold"] is None and r["speculative_tokens"] == 0 for r in spread)
            # A live hold is router state only: the index, its digest and its export are unchanged.
            assert held.live()
            assert (a.index.digest(), len(a.index), a.index.export_workers(W)) == before
            digest = await (await s.get(f"{url_held}/v1/digest")).json()
            assert digest == {"digest": before[0], "holder_blocks": before[1]}
            (w,) = chosen
            scores = (await _post(s, f"{url_held}/v1/score", {"token_ids": p}))["scores"]
            assert scores == [
                {
                    "instance_id": w[0],
                    "dp_rank": w[1],
                    "matched_tokens": 0,
                    "by_medium": {},
                    "score": 0.0,
                    "speculative_tokens": 4 * BS,
                }
            ]
            # The chosen worker's engine prefilled: its BlockStored confirms and ends the hold.
            fleet.store(w, p)
            await _wait(lambda: len(a.index) == 3 * 4 + 4, "the prompt's blocks")
            scores = (await _post(s, f"{url_held}/v1/score", {"token_ids": p}))["scores"]
            assert [(x["instance_id"], x["dp_rank"], x["matched_tokens"]) for x in scores] == [(*w, 4 * BS)]
            assert "speculative_tokens" not in scores[0]  # no live hold: the plain answer
            assert len(held) == 0 and held.confirmed == 1
            r = await _post(s, f"{url_held}/v1/route", {"token_ids": p})
            assert (r["worker"]["instance_id"], r["worker"]["dp_rank"]) == w
            assert (r["matched_tokens"], r["speculative_tokens"]) == (4 * BS, 0)
    finally:
        await fleet.close()


@pytest.mark.integration
async def test_an_unconfirmed_hold_stops_counting_after_its_ttl(kafka_bootstrap, new_topic):
    fleet = Fleet(kafka_bootstrap, new_topic())
    await fleet.member.start()
    try:
        for i, w in enumerate(W):
            fleet.store(w, prompt(600 + i))
        a = fleet.member.applier
        await _wait(lambda: len(trusted_workers(a)) == 3 and len(a.index) == 3 * 4, "the fleet")
        ttl = 0.5
        url = await fleet.serve(Holds(ttl))
        p = prompt(700)
        async with aiohttp.ClientSession() as s:
            t0 = time.monotonic()
            r = await _post(s, f"{url}/v1/route", {"token_ids": p})
            assert r["hold"] == {"expires_in_ms": 500}
            first = (await _post(s, f"{url}/v1/score", {"token_ids": p}))["scores"]
            if time.monotonic() - t0 < ttl:  # answered inside the TTL (on a loaded machine it may not be)
                assert [x["speculative_tokens"] for x in first] == [4 * BS]
            while True:
                scores = (await _post(s, f"{url}/v1/score", {"token_ids": p}))["scores"]
                if not scores:
                    break
                assert time.monotonic() - t0 < 60, "the hold never expired"
                await asyncio.sleep(0.05)
            assert time.monotonic() - t0 >= ttl  # it counted until its TTL, never confirmed
    finally:
        await fleet.close()
