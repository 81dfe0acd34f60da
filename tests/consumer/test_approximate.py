"""Workers whose source cannot observe removals (``source`` ending in "/approximate") are
marked approximate in /v1/workers and in every score that credits them: over HTTP (JSON and
binary bodies), in process, and through the Python decode path; a new epoch from a source
that observes removals clears the mark."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiokafka import AIOKafkaProducer

from kvwire.consumer.apply import Applier
from kvwire.consumer.http import make_app
from kvwire.consumer.router import EmbeddedIndex, Scorer
from kvwire.schemas import codec
from kvwire.schemas.events import EventBatch, WorkerId, stored

TOKENS = list(range(48))
BIN = {"content-type": "application/octet-stream"}


def batch(inst: str, epoch: int, source: str, hashes: list[int]) -> EventBatch:
    """A reset record holding the first len(hashes) 16-token blocks of TOKENS."""
    ev = stored(hashes, TOKENS[: 16 * len(hashes)], 16)
    return EventBatch(WorkerId(inst), epoch, 0, 1, (ev,), reset=True, source=source)


FIRST = [
    batch("exact", 1, "vllm-connector", [11, 12, 13]),
    batch("approx", 2, "lmcache/approximate", [21, 22]),
]
# The approximate worker restarts under a source that observes removals.
SECOND = [batch("approx", 3, "vllm-connector", [31])]


async def answers(applier: Applier) -> tuple[dict[str, bool], list[dict], list[dict]]:
    """(/v1/workers' approximate per instance, JSON-body scores, in-process scores) after
    checking the binary body and the in-process bytes answer the JSON body's bytes."""
    async with TestClient(TestServer(make_app(applier, lambda: True))) as c:
        workers = (await (await c.get("/v1/workers")).json())["workers"]
        rj = await (await c.post("/v1/score", json={"token_ids": TOKENS})).read()
        rb = await (await c.post("/v1/score", data=np.asarray(TOKENS, "<u4").tobytes(), headers=BIN)).read()
    assert rj == rb
    scorer = Scorer(applier)
    assert rj == b'{"scores":' + scorer.score_json(TOKENS) + b"}"
    in_process = [msgspec.to_builtins(s) for s in scorer.score(TOKENS)]
    return {w["instance_id"]: w["approximate"] for w in workers}, json.loads(rj)["scores"], in_process


def expect(marks: dict[str, bool], http: list[dict], in_process: list[dict], approx: set[str]) -> None:
    assert marks == {"exact": "exact" in approx, "approx": "approx" in approx}
    # Both workers hold a prefix of TOKENS, so both are credited.
    assert {s["instance_id"] for s in http} == {"exact", "approx"}
    for s in http:
        assert s.get("approximate", False) is (s["instance_id"] in approx)
    assert in_process == http


def applier_of(recs: list[EventBatch]) -> Applier:
    a = Applier()
    for b in recs:
        a.apply_batch(b)
    return a


def test_python_decode_path_marks_exactly_the_approximate_worker():
    a = applier_of(FIRST)
    marks, http, mine = asyncio.run(answers(a))
    expect(marks, http, mine, {"approx"})
    # Applier.score (list of WorkerScore) carries the mark too.
    assert {s.instance_id: s.approximate for s in a.score(TOKENS)} == {"exact": False, "approx": True}
    for b in SECOND:
        a.apply_batch(b)
    marks, http, mine = asyncio.run(answers(a))
    expect(marks, http, mine, set())


def test_a_snapshot_keeps_the_mark_and_an_older_one_restores_exact():
    from kvwire.consumer.snapshot import RankRecord, SnapshotBody, capture, decode_snapshot, encode_snapshot, load

    a = applier_of(FIRST)
    # Both workers in one partition, as if one member owned them.
    a.workers_by_partition[0] = {("exact", 0), ("approx", 0)}
    body = decode_snapshot(encode_snapshot(capture(a, "t", 0)))
    b = Applier()
    load(b, body)
    assert b.ranks.approximate_workers() == {("approx", 0)}
    assert {s.instance_id: s.approximate for s in b.score(TOKENS)} == {"exact": False, "approx": True}
    # A snapshot written before ranks carried the mark: its rank records end before it.
    old = SnapshotBody(**{f: getattr(body, f) for f in SnapshotBody.__struct_fields__})
    raw = msgspec.msgpack.encode(old)
    legacy = msgspec.msgpack.decode(raw)
    legacy[4] = [r[: RankRecord.__struct_fields__.index("approximate")] for r in legacy[4]]
    c = Applier()
    load(c, msgspec.msgpack.decode(msgspec.msgpack.encode(legacy), type=SnapshotBody))
    assert c.ranks.approximate_workers() == set()


@pytest.mark.integration
def test_through_the_broker_and_a_real_index_member(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1)

    async def produce(recs: list[EventBatch]) -> None:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            for b in recs:
                await producer.send_and_wait(topic, codec.encode(b), key=b.worker.instance_id.encode())
        finally:
            await producer.stop()

    asyncio.run(produce(FIRST))
    with EmbeddedIndex(kafka_bootstrap, topic, group=f"{topic}.router", snapshots=False) as ix:
        ix.wait_ready(timeout_s=120)
        assert ix.failure is None
        applier = ix.member.applier
        marks, http, mine = asyncio.run(answers(applier))
        expect(marks, http, mine, {"approx"})

        asyncio.run(produce(SECOND))
        # The member applies the new epoch in its own time: wait for it (no timing asserted).
        deadline = time.monotonic() + 120
        while not any(w["instance_id"] == "approx" and w["ranks"][0]["epoch"] == 3 for w in ix.workers()):
            assert time.monotonic() < deadline, "the new epoch never reached the index"
            time.sleep(0.1)
        marks, http, mine = asyncio.run(answers(applier))
        expect(marks, http, mine, set())
