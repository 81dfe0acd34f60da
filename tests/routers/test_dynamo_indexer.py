"""Dynamo 1.6.1's standalone indexer (``python -m dynamo.indexer``), registered against kvwire's
event streams with their replay endpoints and started after the events, answers ``/query`` as
the engines' caches say: every worker's leading tokens of every prompt. Also once an engine has
died (never credited again) and when restarted after more than 10,000 batches.

Dynamo hashes the token ids itself (v1 content hashes) and keys blocks by the streams'
``block_hashes`` (kvwire's keys): its answers agreeing with the caches is the shared hash at work.
Everything is real: kvwire's publisher, the broker, ``kvwire index --event-streams``, Dynamo."""

from __future__ import annotations

import pytest
from polling import free_port, wait_for
from router_procs import IndexProcess, Proc, http_json, wait_http
from routing_fleet import E0, RANKS, WORKERS, build, churn, stream_seq, topic_sync
from streams_fleet import Fleet

pytestmark = pytest.mark.integration

MODEL = "m"


def start_indexer(cmd: list[str], index: IndexProcess) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc([*cmd, "--port", str(port), "--block-size", "16", "--model-name", MODEL], "dynamo.indexer")
    base = f"http://127.0.0.1:{port}"
    wait_http(base + "/workers", proc)
    for s in index.streams():
        body = {
            "instance_id": s["worker_id"],
            "endpoint": s["endpoint"],
            "replay_endpoint": s["replay_endpoint"],
            "model_name": MODEL,
            "block_size": 16,
            "dp_rank": s["dp_rank"],
        }
        status, answer = http_json(base + "/register", body)
        assert status == 201, answer
    return proc, base


def answers(base: str, fleet: Fleet) -> dict[int, dict[int, int]]:
    """prompt -> {worker_id: tokens on the device tier} as Dynamo answers."""
    out = {}
    for p in range(16):
        status, body = http_json(base + "/query", {"token_ids": fleet.prompts[p], "model_name": MODEL})
        assert status == 200, body
        out[p] = {int(w): sum(dps.values()) for w, dps in body["scores"].items() if sum(dps.values())}
    return out


def caches(fleet: Fleet, ids: dict[tuple[str, int], int], alive: list[tuple[str, int]]) -> dict[int, dict[int, int]]:
    """The same from the engines' caches."""
    out = {}
    for p in range(16):
        got = fleet.longest(RANKS, fleet.prompts[p])
        out[p] = {ids[w]: n for w, n in got.items() if n and w in alive}
    return out


def check(base: str, fleet: Fleet, want: dict[int, dict[int, int]], proc: Proc) -> None:
    # Dynamo reads each stream in the background: wait until the answers stop differing (the
    # limit bounds a hang), then they must all be equal.
    try:
        wait_for(lambda: answers(base, fleet) == want, "dynamo.indexer caught up", timeout=60)
    except AssertionError:
        got = answers(base, fleet)
        diff = {p: (got[p], want[p]) for p in want if got[p] != want[p]}
        raise AssertionError(f"{len(diff)} prompts differ (got, want): {diff}\n{proc.tail()}") from None


def test_dynamo_indexer_answers_as_the_caches(kafka_bootstrap, dynamo_indexer, procs):
    with topic_sync(kafka_bootstrap) as t:
        fleet = build(kafka_bootstrap, t)
        index = IndexProcess(kafka_bootstrap, t, heartbeat_timeout_s=3.0)
        procs.append(index)
        wait_for(lambda: len(index.streams()) == len(WORKERS), "a stream per worker")
        ids = {(s["instance_id"], s["dp_rank"]): s["worker_id"] for s in index.streams()}
        dyn, base = start_indexer(dynamo_indexer, index)
        procs.append(dyn)
        want = caches(fleet, ids, WORKERS)
        assert sum(len(v) for v in want.values()) >= 30
        check(base, fleet, want, dyn)

        # An engine dies: its stream clears, and Dynamo credits it nothing more.
        fleet.pubs["e2"].close()
        wait_for(lambda: ("e2", 0, 0) not in index.ranks(), "kvwire expired e2")
        alive = [w for w in WORKERS if w[0] != "e2"]
        assert any(ids[("e2", 0)] in v for v in want.values())
        check(base, fleet, caches(fleet, ids, alive), dyn)

        # Restarted after more than 10,000 batches of one stream.
        dyn.stop()
        churn(fleet, E0, 10_200)
        last = fleet.rank(E0).stats().next_seq - 1
        wait_for(lambda: index.ranks()[("e0", 0, 0)]["last_seq"] >= last, "kvwire applied the churn", timeout=120)
        assert stream_seq(next(s for s in index.streams() if s["instance_id"] == "e0")) > 10_000
        dyn, base = start_indexer(dynamo_indexer, index)
        procs.append(dyn)
        check(base, fleet, caches(fleet, ids, alive), dyn)
        for p in fleet.pubs.values():
            p.close()
