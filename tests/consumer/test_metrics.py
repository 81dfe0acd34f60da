"""The member's latency histograms: exported exactly as prometheus_client's own Histogram
exports the same observations (the oracle), from any number of observing threads."""

from __future__ import annotations

import random
import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvwire.consumer.metrics import LATENCY_BUCKETS, LatencyHistogram


def _lines(registry: CollectorRegistry) -> list[str]:
    # prometheus_client's Histogram adds a _created sample per child; ours has no creation time.
    return sorted(ln for ln in generate_latest(registry).decode().splitlines() if "_created" not in ln)


def _observations(seed: int, n: int) -> list[tuple[str, float]]:
    rng = random.Random(seed)
    # Bounds themselves (a bucket's le is inclusive), values between them, zero, past the last.
    values = [*LATENCY_BUCKETS, 0.0, 3.0, 1e-7]
    return [
        (rng.choice(["local", "scatter"]), rng.choice(values) if rng.random() < 0.3 else rng.uniform(0, 3))
        for _ in range(n)
    ]


def test_latency_histogram_exports_what_prometheus_histogram_exports():
    ours_reg, theirs_reg = CollectorRegistry(), CollectorRegistry()
    ours = LatencyHistogram("kvwire_x_seconds", "doc", ours_reg)
    theirs = Histogram("kvwire_x_seconds", "doc", ["scope"], buckets=LATENCY_BUCKETS, registry=theirs_reg)
    for scope, v in _observations(1, 5000):
        ours.observe(scope, v)
        theirs.labels(scope).observe(v)
    assert _lines(ours_reg) == _lines(theirs_reg)


def test_latency_histogram_counts_every_thread_observation():
    reg = CollectorRegistry()
    h = LatencyHistogram("kvwire_x_seconds", "doc", reg)
    obs = [_observations(seed, 3000) for seed in range(4)]
    threads = [threading.Thread(target=lambda o=o: [h.observe(s, v) for s, v in o]) for o in obs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [x for o in obs for x in o]
    for scope in ("local", "scatter"):
        mine = [v for s, v in flat if s == scope]
        assert reg.get_sample_value("kvwire_x_seconds_count", {"scope": scope}) == len(mine)
        assert reg.get_sample_value("kvwire_x_seconds_bucket", {"scope": scope, "le": "0.001"}) == sum(
            v <= 0.001 for v in mine
        )
        assert abs(reg.get_sample_value("kvwire_x_seconds_sum", {"scope": scope}) - sum(mine)) < 1e-6


def test_latency_histogram_exports_nothing_before_an_observation():
    reg = CollectorRegistry()
    LatencyHistogram("kvwire_x_seconds", "doc", reg)
    assert [ln for ln in _lines(reg) if not ln.startswith("#")] == []
