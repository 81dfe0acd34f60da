"""Prometheus metrics of one index member.

Each member owns its registry so several members can live in one process
(tests, the demo) without colliding. Lag quantiles are computed over a
sliding window of recent samples: Prometheus histograms give buckets, and
operators asked for p50/p99 directly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LAG_WINDOW = 4096
# Seconds: an in-process answer takes ~25 µs, a scatter over peers up to their timeout.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class IngestMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.records = Counter("kvwire_records_applied", "Kafka records decoded and fenced", registry=r)
        self.blocks = Counter("kvwire_blocks_applied", "Blocks stored or removed in the index", registry=r)
        self.skipped = Counter("kvwire_records_skipped", "Records not applied", ["reason"], registry=r)
        self.gaps = Counter("kvwire_gap_batches", "Batches producers reported lost", registry=r)
        self.resets = Counter("kvwire_rank_resets", "Rank resets applied (new epochs, first records)", registry=r)
        self.expired = Counter("kvwire_ranks_expired", "Ranks dropped after the heartbeat timeout", registry=r)
        self.dead_letters = Counter(
            "kvwire_dead_letters", "Malformed records sent to the dead-letter topic", registry=r
        )
        self.lag_hist = Histogram(
            "kvwire_apply_lag_seconds",
            "Record timestamp to applied",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.lag_quantile = Gauge(
            "kvwire_apply_lag_seconds_q", "Apply lag quantile over recent records", ["quantile"], registry=r
        )
        self.consumer_lag = Gauge("kvwire_consumer_lag_records", "End offset minus position", ["partition"], registry=r)
        self.index_holder_blocks = Gauge("kvwire_index_holder_blocks", "Holder-blocks in the index", registry=r)
        self.index_bytes = Gauge("kvwire_index_bytes", "Bytes held by the index tables", registry=r)
        self.workers = Gauge("kvwire_workers", "Workers known, by trust", ["trusted"], registry=r)
        # 1 while the member is unhealthy for this reason (ingest_task_dead, snapshot_task_dead,
        # snapshots_failing); /healthz answers 503 and `kvwire index` exits.
        self.failed = Gauge("kvwire_index_failed", "Why the member is unhealthy (1 = failing)", ["reason"], registry=r)
        self.snapshot_failures = Counter("kvwire_snapshot_failures", "Snapshot attempts that failed", registry=r)
        self.score_latency = Histogram(
            "kvwire_score_latency_seconds",
            "Time to answer POST /v1/score (local index and any peers)",
            ["scope"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.route_latency = Histogram(
            "kvwire_route_latency_seconds",
            "Time to answer POST /v1/route (local index and any peers)",
            ["scope"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self._lags: deque[int] = deque(maxlen=LAG_WINDOW)
        self._holds: Any = None

    def watch_holds(self, holds: Any) -> None:
        """Export a member's speculative holds (``consumer.holds.Holds``), read at scrape time.
        Apps of one member share one ``Holds``: watching it again is a no-op."""
        if self._holds is holds:
            return
        if self._holds is None:
            self.registry.register(_HoldsCollector(self))
        self._holds = holds

    def observe_lag_us(self, lag_us: int) -> None:
        self._lags.append(lag_us)
        self.lag_hist.observe(max(lag_us, 0) / 1e6)

    def lag_quantiles_ms(self) -> dict[str, float | None]:
        s = sorted(self._lags)
        if not s:
            return {"p50": None, "p99": None}
        return {"p50": s[len(s) // 2] / 1000, "p99": s[min(len(s) - 1, int(len(s) * 0.99))] / 1000}

    def render(self) -> bytes:
        q = self.lag_quantiles_ms()
        for k, v in q.items():
            if v is not None:
                self.lag_quantile.labels(k[1:]).set(v / 1000)
        return generate_latest(self.registry)


class _HoldsCollector:
    """Holds live now, and how many were made and ended (confirmed by the worker's own
    BlockStored, or expired): a high expired share means the TTL is shorter than the lag."""

    def __init__(self, metrics: IngestMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        h = self.metrics._holds
        yield GaugeMetricFamily("kvwire_holds_live", "Speculative holds counting now", value=len(h))
        yield CounterMetricFamily("kvwire_holds_made", "Speculative holds recorded by /v1/route", value=h.made)
        ended = CounterMetricFamily("kvwire_holds_ended", "Speculative holds ended, by why", labels=["why"])
        ended.add_metric(["confirmed"], h.confirmed)
        ended.add_metric(["expired"], h.expired)
        yield ended
