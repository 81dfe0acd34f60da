"""Operations conventions: the router's default group id, the score-latency histogram, /healthz
with a failure, and the replication defaults every kvwire topic gets."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvwire.consumer.apply import Applier
from kvwire.consumer.http import make_app
from kvwire.consumer.ingest import GAUGE_INTERVAL_S, IngestConfig, default_group_id, gauges_due
from kvwire.kafka.topics import Replication
from kvwire.schemas.events import EventBatch, WorkerId, stored


def test_default_group_id_is_stable_and_one_per_router():
    a = default_group_id("kvwire.events", 8080, host="router-1")
    assert a == "kvwire-index.kvwire.events.router-1.8080"
    assert default_group_id("kvwire.events", 8080, host="router-1") == a  # a restart keeps it
    assert default_group_id("kvwire.events", 8081, host="router-1") != a  # a second router on the host
    assert default_group_id("kvwire.events", 8080, host="router-2") != a
    assert a.startswith("kvwire-index.")  # one prefix for ACLs
    # Embedded members without a group keep a fresh one each (two in one process stay apart).
    cfg = IngestConfig("b:9092", "t")
    assert cfg.resolved_group() != IngestConfig("b:9092", "t").resolved_group()


def test_gauges_are_set_on_idle_polls_and_at_most_every_interval_while_busy():
    assert gauges_due(10.0, None, polled_records=True)  # the first poll
    assert not gauges_due(10.0 + GAUGE_INTERVAL_S / 2, 10.0, polled_records=True)
    assert gauges_due(10.0 + GAUGE_INTERVAL_S / 2, 10.0, polled_records=False)  # idle: at once
    assert gauges_due(10.0 + GAUGE_INTERVAL_S, 10.0, polled_records=True)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


async def test_score_latency_histogram_counts_each_score():
    a = Applier()
    a.apply_batch(EventBatch(WorkerId("w1"), 1, 0, 1, (stored([11, 12], range(32), 16),), reset=True))
    async with TestClient(TestServer(make_app(a, lambda: True))) as c:
        for _ in range(3):
            assert (await c.post("/v1/score", json={"token_ids": list(range(32))})).status == 200
        assert (await c.post("/v1/score", json={"token_ids": "x"})).status == 400  # refused, not timed
        text = await (await c.get("/metrics")).text()
    assert _metric(text, 'kvwire_score_latency_seconds_count{scope="local"}') == 3.0
    assert _metric(text, 'kvwire_score_latency_seconds_bucket{le="+Inf",scope="local"}') == 3.0
    assert _metric(text, 'kvwire_score_latency_seconds_sum{scope="local"}') > 0


async def test_healthz_is_503_with_the_reason_while_unhealthy():
    failure: dict[str, str | None] = {"why": None}
    async with TestClient(TestServer(make_app(Applier(), lambda: True, health=lambda: failure["why"]))) as c:
        r = await c.get("/healthz")
        assert r.status == 200 and await r.json() == {"ready": True, "healthy": True}
        failure["why"] = "snapshots_failing: 5 snapshot attempts failed"
        r = await c.get("/healthz")
        assert r.status == 503
        assert await r.json() == {"ready": True, "healthy": False, "failure": failure["why"]}


@pytest.mark.parametrize(
    "brokers, env, want",
    [
        (1, {}, (1, 1)),
        (2, {}, (2, 1)),
        (3, {}, (3, 2)),
        (5, {}, (3, 2)),  # three copies are enough; more brokers spread partitions, not copies
        (5, {"KVWIRE_REPLICATION_FACTOR": "5"}, (5, 2)),
        (3, {"KVWIRE_MIN_INSYNC_REPLICAS": "3"}, (3, 3)),
    ],
)
def test_replication_defaults_follow_the_cluster_size(brokers, env, want):
    assert Replication.from_env(env).resolve(brokers) == want


def test_replication_explicit_values_win_and_impossible_ones_fail():
    assert Replication.from_env({"KVWIRE_REPLICATION_FACTOR": "3"}, replication_factor=1).resolve(3) == (1, 1)
    with pytest.raises(ValueError, match=r"min.insync.replicas 3 exceeds the replication factor 2"):
        Replication(2, 3)
    with pytest.raises(ValueError, match="KVWIRE_REPLICATION_FACTOR"):
        Replication.from_env({"KVWIRE_REPLICATION_FACTOR": "three"})
