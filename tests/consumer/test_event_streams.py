"""kvwire's vLLM-format event streams, through a real broker, read by a subscriber that decodes
with vLLM's own classes and asks for history the way the routers do (``tests/stream_client.py``).

The oracle is the engines' caches (``tests/streams_fleet.py`` keeps them beside the records it
publishes, with v1 keys computed outside kvwire's core): what a subscriber holds once it has
read everything the stream sent must equal, per worker and medium, the blocks every TP rank of
the worker holds, and nothing while kvwire does not trust the worker."""

from __future__ import annotations

import asyncio
import random

import pytest
from stream_client import StreamClient
from streams_fleet import Fleet, caught_up, prompts, serve, topic, until

from kvwire.consumer import event_streams
from kvwire.consumer.event_streams import EventStreams
from kvwire.schemas.events import WorkerId

pytestmark = pytest.mark.integration

A = WorkerId("a", 0, 0, 1)
B0, B1 = WorkerId("b", 0, 0, 2), WorkerId("b", 0, 1, 2)
C = WorkerId("c", 1, 0, 1)
RANKS = [A, B0, B1, C]


def client(streams: EventStreams, worker: tuple[str, int]) -> StreamClient:
    entry = next(s for s in streams.listing() if (s["instance_id"], s["dp_rank"]) == worker)
    return StreamClient(entry["endpoint"], entry["replay_endpoint"])


async def read_all(c: StreamClient, streams: EventStreams, worker: tuple[str, int]) -> None:
    """Until the client has every batch the stream sent so far (a heartbeat shows it the end).
    The client blocks on its sockets as a router's does, so it runs off the loop that serves them."""
    for _ in range(1200):
        await asyncio.to_thread(c.poll, 50)
        if c.next_seq is not None and c.next_seq >= streams.seq(worker):
            return
    raise AssertionError(f"never read the stream of {worker} to its end")


def workload(fleet: Fleet, rng: random.Random, steps: int, ranks: list[WorkerId]) -> None:
    for _ in range(steps):
        r = rng.choice(ranks)
        p = rng.randrange(len(fleet.prompts))
        medium = rng.choice(["GPU", "GPU", "CPU"])
        if rng.random() < 0.7:
            fleet.store(r, p, rng.randrange(1, 9), medium)
        else:
            fleet.evict(r, p, rng.randrange(0, 4), medium)


def test_streams_equal_the_engines_caches(kafka_bootstrap):
    asyncio.run(_equal(kafka_bootstrap))


async def _equal(bootstrap):
    rng = random.Random(3)
    async with topic(bootstrap) as t:
        fleet = Fleet(bootstrap, t, prompts(6))
        for r in RANKS:
            fleet.rank(r)
        async with serve(bootstrap, t) as (member, streams):
            await until(lambda: len(streams.listing()) == 3, "three streams")
            early = {w: client(streams, w) for w in [("a", 0), ("b", 0), ("c", 1)]}
            workload(fleet, rng, 150, RANKS)
            # Both TP ranks of b hold prompt 0's first 4 blocks; only rank 0 holds its 5th to 8th.
            for r in (B0, B1):
                fleet.evict(r, 0, 0)
            fleet.store(B0, 0, 8)
            fleet.store(B1, 0, 4)
            await caught_up(member, fleet)
            late = {w: client(streams, w) for w in early}
            truth = fleet.truth(RANKS)
            for w in early:
                for c in (early[w], late[w]):
                    await read_all(c, streams, w)
                    assert c.violations == []
                    assert c.state() == truth[w], w
            assert all(c.replays >= 1 for c in late.values())  # late joiners learned through replay
            b = late[("b", 0)].state()["GPU"]
            assert b >= set(v1_prefix(fleet, 0, 4)) and not b >= set(v1_prefix(fleet, 0, 5))
            # kvwire's keys are the index's own: the stream's state is what the index holds.
            idx = member.applier.index
            for w, c in late.items():
                core = {m: set(k) for (m, _g), k in idx.worker_held(w).items()}
                assert c.state() == core
            for c in [*early.values(), *late.values()]:
                c.close()
        await fleet.close()


def v1_prefix(fleet: Fleet, p: int, n: int) -> list[int]:
    from streams_fleet import BS, v1_keys

    return v1_keys(fleet.prompts[p][: n * BS])


def test_trust_lost_clears_and_trust_back_sends_the_whole_state(kafka_bootstrap):
    asyncio.run(_trust(kafka_bootstrap))


async def _trust(bootstrap):
    async with topic(bootstrap) as t:
        fleet = Fleet(bootstrap, t, prompts(4))
        async with serve(bootstrap, t) as (member, streams):
            for p in range(4):
                fleet.store(A, p, 6)
            await caught_up(member, fleet)
            c = client(streams, ("a", 0))
            await read_all(c, streams, ("a", 0))
            assert c.state() == fleet.truth([A])[("a", 0)] != {}
            clears = c.clears
            fleet.gap(A)
            fleet.store(A, 0, 8)  # applied by the index, but the worker is not trusted
            await caught_up(member, fleet)
            await read_all(c, streams, ("a", 0))
            assert c.clears == clears + 1
            assert c.state() == {}
            assert not member.applier.ranks.worker_trusted(("a", 0))
            # A new epoch starts with a reset: kvwire knows the engine's whole state again.
            fleet.restart(A)
            fleet.store(A, 1, 3)
            fleet.store(A, 2, 5, "CPU")
            await caught_up(member, fleet)
            await read_all(c, streams, ("a", 0))
            assert member.applier.ranks.worker_trusted(("a", 0))
            assert c.violations == []
            assert (
                c.state()
                == fleet.truth([A])[("a", 0)]
                == {
                    "GPU": set(v1_prefix(fleet, 1, 3)),
                    "CPU": set(v1_prefix(fleet, 2, 5)),
                }
            )
            c.close()
        await fleet.close()


@pytest.mark.parametrize("small_batches", [False, True])
def test_replay_older_than_the_buffer_is_the_whole_state(kafka_bootstrap, monkeypatch, small_batches):
    if small_batches:  # a state cut into many batches and chains, parents still first
        monkeypatch.setattr(event_streams, "MAX_BATCH_EVENTS", 2)
        monkeypatch.setattr(event_streams, "MAX_RUN_BLOCKS", 3)
    asyncio.run(_old_replay(kafka_bootstrap))


async def _old_replay(bootstrap):
    rng = random.Random(11)
    async with topic(bootstrap) as t:
        fleet = Fleet(bootstrap, t, prompts(8))
        async with serve(bootstrap, t, buffer_batches=10) as (member, streams):
            # Far more batches than the buffer keeps, with evictions, before anyone subscribes
            # (a stream sends one batch per applied slice: the records go in one by one).
            for _ in range(40):
                workload(fleet, rng, 3, [A])
                await caught_up(member, fleet)
            assert streams.seq(("a", 0)) > 30
            c = client(streams, ("a", 0))
            await read_all(c, streams, ("a", 0))
            assert c.replays >= 1 and c.violations == []  # parents before children in the compaction
            assert c.state() == fleet.truth([A])[("a", 0)] != {}
            # And a client asking from seq 0 by itself, as a restarted router does.
            again = client(streams, ("a", 0))
            await asyncio.to_thread(again._replay, 0)
            assert again.violations == []
            assert again.state() == c.state()
            # A replay past the buffer is the state itself: nothing stored on the way is gone at
            # its end (re-applied history would store blocks since removed, then remove them).
            for x in (c, again):
                end = set().union(*x.state().values())
                assert x.replay_stored and all(r <= end for r in x.replay_stored)
            for x in (c, again):
                x.close()
        await fleet.close()


def test_an_expired_worker_is_cleared_and_stays_listed(kafka_bootstrap):
    asyncio.run(_expired(kafka_bootstrap))


async def _expired(bootstrap):
    async with topic(bootstrap) as t:
        fleet = Fleet(bootstrap, t, prompts(2), heartbeat_interval_s=0.2)
        async with serve(bootstrap, t, heartbeat_timeout_s=2.0) as (member, streams):
            fleet.store(A, 0, 4)
            await caught_up(member, fleet)
            c = client(streams, ("a", 0))
            await read_all(c, streams, ("a", 0))
            assert c.state() != {}
            # The engine dies: its publisher stops, heartbeats with it, and the member expires it.
            await fleet.kill("a")
            await until(lambda: not member.applier.ranks.worker_trusted(("a", 0)), "the silent worker expired")
            await read_all(c, streams, ("a", 0))
            assert c.state() == {}
            assert [s["instance_id"] for s in streams.listing()] == ["a"]
            c.close()


async def test_v1_streams_lists_each_stream_and_404_without_streams():
    from aiohttp.test_utils import TestClient, TestServer
    from streams_fleet import free_base

    from kvwire.consumer.apply import Applier
    from kvwire.consumer.http import make_app
    from kvwire.consumer.worker_ids import worker_id
    from kvwire.schemas.events import EventBatch, stored

    applier = Applier()
    async with TestClient(TestServer(make_app(applier, lambda: True))) as c:
        r = await c.get("/v1/streams")
        assert r.status == 404 and "--event-streams" in (await r.json())["error"]
    base = free_base()
    streams = EventStreams(applier, "127.0.0.1", base)
    await streams.start()
    try:
        for inst, dp in (("eng-1", 0), ("eng-1", 1), ("7", 0)):
            ev = stored([1], range(32), 32, medium="GPU")
            applier.apply_batch(EventBatch(WorkerId(inst, dp, 0, 1, model="m1"), 1, 0, 1, (ev,), reset=True))
        async with TestClient(TestServer(make_app(applier, lambda: True, streams=streams))) as c:
            body = await (await c.get("/v1/streams")).json()
        ports = iter(range(base, base + 6))
        assert body == {
            "streams": [
                {
                    "instance_id": inst,
                    "dp_rank": dp,
                    "worker_id": worker_id(inst),
                    "endpoint": f"tcp://127.0.0.1:{next(ports)}",
                    "replay_endpoint": f"tcp://127.0.0.1:{next(ports)}",
                    "block_size": 32,
                    "model": "m1",
                }
                for inst, dp in (("eng-1", 0), ("eng-1", 1), ("7", 0))
            ]
        }
        assert body["streams"][2]["worker_id"] == 7  # a decimal instance id is its own worker id
        assert body["streams"][0]["worker_id"] == body["streams"][1]["worker_id"]  # one per instance
    finally:
        await streams.stop()
