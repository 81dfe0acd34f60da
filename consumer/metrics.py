"""Prometheus metrics of one index member.

Each member owns its registry so several members can live in one process
(tests, the demo) without colliding. Lag quantiles are computed over a
sliding window of recent samples: Prometheus histograms give buckets, and
operators asked for p50/p99 directly.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

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
        self.score_latency = LatencyHistogram(
            "kvwire_score_latency_seconds", "Time to answer POST /v1/score (local index and any peers)", r
        )
        self.route_latency = LatencyHistogram(
            "kvwire_route_latency_seconds", "Time to answer POST /v1/route (local index and any peers)", r
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


class LatencyHistogram:
    """A histogram of answer latencies by ``scope`` (``LATENCY_BUCKETS``), exported as
    prometheus_client's ``Histogram`` would export it, at a fraction of its cost per observation.

    Why: an HTTP score is observed once per request, and ``Histogram.labels(scope).observe``
    (a lock, a Python loop over the buckets) cost ~10 µs of a ~115 µs request on the member's
    HTTP thread (``bench.http_score``). Here an observation is one bisect and two additions
    into counts owned by the observing thread, which no other thread writes, so no lock is
    needed; a scrape sums every thread's counts."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self._bounds = list(LATENCY_BUCKETS)
        self._mine = threading.local()
        self._threads: list[dict[str, list[float]]] = []  # per thread: scope -> [bucket counts..., +Inf, sum]
        self._lock = threading.Lock()  # guards _threads, not the counts
        registry.register(self)

    def observe(self, scope: str, seconds: float) -> None:
        try:
            counts = self._mine.by_scope[scope]
        except (AttributeError, KeyError):
            counts = self._counts(scope)
        counts[bisect_left(self._bounds, seconds)] += 1  # the first bucket whose bound is >= seconds
        counts[-1] += seconds

    def _counts(self, scope: str) -> list[float]:
        by_scope = getattr(self._mine, "by_scope", None)
        if by_scope is None:
            by_scope = self._mine.by_scope = {}
            with self._lock:
                self._threads.append(by_scope)
        counts = by_scope[scope] = [0.0] * (len(self._bounds) + 2)
        return counts

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=["scope"])

    def collect(self) -> Iterator[Metric]:
        totals: dict[str, list[float]] = {}
        with self._lock:
            threads = list(self._threads)
        for by_scope in threads:
            for scope, counts in list(by_scope.items()):
                now = list(counts)  # one copy: the buckets and their total read at one moment
                acc = totals.setdefault(scope, [0.0] * len(now))
                for i, c in enumerate(now):
                    acc[i] += c
        family = HistogramMetricFamily(self.name, self.documentation, labels=["scope"])
        for scope, acc in sorted(totals.items()):
            cumulative, buckets = 0.0, []
            for bound, c in zip([*self._bounds, float("inf")], acc[:-1], strict=True):
                cumulative += c
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([scope], buckets, sum_value=acc[-1])
        yield family


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
