"""Soak: one index process under steady churn for 30 minutes; does its memory plateau?

A fleet of ``--workers`` engines (default 64) each keeps a fixed-capacity LRU block pool
(``--holder-blocks`` / workers blocks; 2M holder-blocks in all by default). Each stores new
conversations in ``bench.index_memory.Workload``'s shape (8k tokens, 16-token blocks, chained
parent hashes, token ids, one of its 16 shared 1k-token system prompts, random 64-bit engine
hashes) and sends BlockRemoved for the blocks its pool evicts to make room, in the order vLLM's
free queue evicts them: a finished request's blocks go back tail first, and a system prompt the
pool still holds is a prefix hit (touched, not stored again). Every ``--clear-every-s`` one worker
in turn sends AllBlocksCleared and refills. Records are real Avro bytes (``kvwire.schemas.codec``,
as ``bench.apply_rate.make_records``: 2 BlockStored of 16 blocks per record, after that record's
BlockRemoved) fed to ``Applier.apply_records``, the consumer's own path, paced to ``--rate`` stored
blocks/s (plus as many removed once the pools are full), beside ``--qps`` 8k-token score queries
(``PrefixIndex.score_arrays``, top 16: a recent conversation, a system prompt and new text, a
miss). Once the pools are full the fleet holds a fixed number of holder-blocks, so a correct
index's memory plateaus.

Every ``--sample-s`` it samples the process's RssAnon (``/proc/self/status``) and the index's own
``nbytes()``. Warm-up is the first 20% of the run or until every pool has filled, whichever is
later; ``soak_rss_growth_pct`` = (max RssAnon over the last 10% of the run − RssAnon at the end
of warm-up) / RssAnon at the end of warm-up × 100 (target ≤ 5), and the same of ``nbytes()``.

    python -m bench.soak [--quick | --smoke] [--duration-s 1800] [--rate 100000] [--workers 64]
        [--holder-blocks 2000000] [--qps 200] [--clear-every-s 60] [--sample-s 10] [--core PATH]

``--quick``: 60 s at 500k holder-blocks; ``--smoke``: 3 s, 8 workers, 16k holder-blocks (the
tests'). ``--core PATH`` loads ``kvwire._core`` from that file (a copy of
``kvwire/_core.abi3.so``, ``bench.ab_core._load_core``), so that rebuilding the extension in place
during a 30-minute run changes nothing in it.

Writes bench/results/soak.json and bench/results/soak.png.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Nothing here imports kvwire._core at module level: ``--core`` must load it first (main()).
from .common import percentiles, write_result

WARMUP_SHARE = 0.2  # warm-up: at least the first 20% of the run
TAIL_SHARE = 0.1  # the growth figure takes the max over the last 10%
EVENTS_PER_RECORD = 2  # BlockStored events per record, as the publisher batches them
PRESETS: dict[str, dict[str, float]] = {
    "full": dict(
        duration_s=1800, rate=100_000, workers=64, holder_blocks=2_000_000, qps=200, clear_every_s=60, sample_s=10
    ),
    "quick": dict(
        duration_s=60, rate=100_000, workers=64, holder_blocks=500_000, qps=200, clear_every_s=10, sample_s=1
    ),
    "smoke": dict(duration_s=3, rate=20_000, workers=8, holder_blocks=16_384, qps=50, clear_every_s=0.5, sample_s=0.1),
}

_EMPTY = np.zeros(0, np.uint64)


def proc_status() -> dict[str, int]:
    """RssAnon and VmRSS of this process, bytes (Linux ``/proc/self/status``)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("RssAnon", "VmRSS"):
                out[name] = int(rest.split()[0]) * 1024  # kB
    return out


class Pool:
    """One engine's fixed-capacity LRU block pool, as engine hashes in segments.

    A segment is one finished conversation's new blocks, or one system prompt's blocks, each
    array in eviction order (tail block first, as vLLM's free queue takes back a finished
    request's blocks in reverse); the OrderedDict is least recently used first. A running
    conversation's blocks are held but not evictable (``running``)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.lru: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self.size = 0  # blocks held: the LRU's segments and the running conversation's
        self.filled = False  # reached capacity at least once

    def take(self, key: tuple[str, int]) -> np.ndarray:
        """A segment in use again (a prefix hit): out of the LRU until released."""
        seg = self.lru.pop(key, None)
        return _EMPTY if seg is None else seg

    def release(self, key: tuple[str, int], evict_order: np.ndarray) -> None:
        """Back into the LRU as its most recently used segment."""
        assert key not in self.lru
        self.lru[key] = evict_order

    def make_room(self, n: int) -> np.ndarray:
        """Evict what storing n more blocks needs, least recently used first; the evicted hashes."""
        need = self.size + n - self.capacity
        out = []
        while need > 0:
            key, seg = next(iter(self.lru.items()))
            if len(seg) <= need:
                del self.lru[key]
                out.append(seg)
                need -= len(seg)
            else:
                out.append(seg[:need])
                self.lru[key] = seg[need:]  # an existing key keeps its place
                need = 0
        gone = np.concatenate(out) if out else _EMPTY
        self.size += n - len(gone)
        if self.size >= self.capacity:
            self.filled = True
        return gone

    def clear(self) -> None:
        self.lru.clear()
        self.size = 0


class Engine:
    """One worker: its rank, its pool and the conversation it is storing."""

    def __init__(self, rank: Any, capacity: int):
        self.rank = rank
        self.key = rank.kafka_key()
        self.pool = Pool(capacity)
        self.seq = 0
        self.conversations = 0
        self.pending: list[tuple[np.ndarray, int | None, np.ndarray]] = []  # (hashes, parent, tokens) per event
        self.sys = -1  # the running conversation's system prompt
        self.new_blocks = _EMPTY  # the running conversation's hashes after its system prompt
        self.tokens: np.ndarray | None = None


class Fleet:
    """The workers and their pools; turns their behaviour into record bytes."""

    def __init__(self, workers: int, capacity: int, seed: int = 0, events_per_record: int = EVENTS_PER_RECORD):
        from kvwire.schemas import codec
        from kvwire.schemas.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, WorkerId

        from .index_memory import BS, CONV_BLOCKS, EV_BLOCKS, N_SYS, SYS_BLOCKS, Workload, _arr

        if capacity < 2 * CONV_BLOCKS:
            raise ValueError(f"{capacity} blocks per worker: a pool must hold at least two conversations")
        self._codec, self._arr = codec, _arr
        self._ev = (GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch)
        self.BS, self.CONV, self.EV, self.N_SYS, self.SYS = BS, CONV_BLOCKS, EV_BLOCKS, N_SYS, SYS_BLOCKS
        wl = Workload(seed, "soak")  # its shared system prompts: tokens and engine hashes
        self.sys_tokens, self.sys_hashes = wl.sys, wl.sys_hashes
        self.rng = wl.rng
        self.events_per_record = events_per_record
        self.epoch = 0x50A4
        self.engines = [Engine(WorkerId(f"soak-{i}", 0, 0, 1, "m"), capacity) for i in range(workers)]
        self.filled = 0  # engines whose pool has reached capacity
        self.recent: deque[np.ndarray] = deque(maxlen=64)  # finished conversations' tokens, to query
        self.clears = 0

    def held(self) -> int:
        """Blocks the pools hold now: what the index must count as holder-blocks."""
        return sum(e.pool.size for e in self.engines)

    def _batch(self, e: Engine, events: tuple) -> bytes:
        EventBatch = self._ev[4]
        b = EventBatch(e.rank, self.epoch, e.seq, time.time_ns() // 1000, events, reset=e.seq == 0)
        e.seq += 1
        return self._codec.encode(b)

    def _start(self, w: int, e: Engine) -> None:
        s = (w + e.conversations) % self.N_SYS
        k = len(e.pool.take(("s", s)))  # the system prompt's leading blocks still held: a hit
        tail = self.rng.integers(0, 2**64, self.CONV - self.SYS, dtype=np.uint64, endpoint=False)
        hashes = np.concatenate([self.sys_hashes[s], tail])
        toks = np.concatenate(
            [self.sys_tokens[s], self.rng.integers(0, 128_000, (self.CONV - self.SYS) * self.BS, dtype=np.uint32)]
        )
        # events of EV blocks from the first block not held; the first one ends at a multiple of EV
        cuts = [k, *range((k // self.EV + 1) * self.EV, self.CONV, self.EV), self.CONV]
        bs = self.BS
        e.pending = [
            (hashes[a:b], int(hashes[a - 1]) if a else None, toks[a * bs : b * bs]) for a, b in itertools.pairwise(cuts)
        ]
        e.sys, e.new_blocks, e.tokens = s, tail, toks
        e.conversations += 1

    def next_record(self, w: int) -> tuple[bytes, int, int]:
        """Worker w's next record: (value, blocks stored, blocks removed)."""
        GPU, _, BlockRemoved, BlockStored, _ = self._ev
        e = self.engines[w]
        if not e.pending:
            self._start(w, e)
        chunk, e.pending = e.pending[: self.events_per_record], e.pending[self.events_per_record :]
        n = sum(len(h) for h, _, _ in chunk)
        was_filled = e.pool.filled
        gone = e.pool.make_room(n)
        if e.pool.filled and not was_filled:
            self.filled += 1
        events: list[Any] = [BlockRemoved(tuple(gone.tolist()), medium=GPU)] if len(gone) else []
        events += [BlockStored(tuple(h.tolist()), p, self._arr(t), self.BS, medium=GPU) for h, p, t in chunk]
        if not e.pending:  # finished: its blocks back to the LRU, tail first, the system prompt after them
            e.pool.release(("c", e.conversations), e.new_blocks[::-1].copy())
            e.pool.release(("s", e.sys), self.sys_hashes[e.sys][::-1].copy())
            assert e.tokens is not None
            self.recent.append(e.tokens)
        return self._batch(e, tuple(events)), n, len(gone)

    def clear(self, w: int) -> bytes:
        """Worker w drops every block (vLLM reset_prefix_cache); its running conversation is gone."""
        e = self.engines[w]
        e.pool.clear()
        e.pending, e.new_blocks, e.tokens = [], _EMPTY, None
        self.clears += 1
        return self._batch(e, (self._ev[1](),))


class _Record:
    """What ``Applier.apply_records`` reads of a Kafka record."""

    __slots__ = ("key", "offset", "timestamp", "value")

    def __init__(self, offset: int, key: bytes, value: bytes):
        self.offset, self.key, self.value, self.timestamp = offset, key, value, 0


def growth(series: list[dict[str, Any]], field: str, warmup_end_s: float | None) -> dict[str, Any]:
    """(max of ``field`` over the last 10% of the run − its value at the first sample at or
    after the end of warm-up) / that value × 100, with the two values; the run ends at the last
    sample. ``pct`` is None, with ``why``, when warm-up never ended or ended in the last 10%."""
    if not series:
        return {"pct": None, "why": "no samples"}
    end = series[-1]["t_s"]
    if warmup_end_s is None:
        return {"pct": None, "why": "the pools never filled: no end of warm-up"}
    at = next((s for s in series if s["t_s"] >= warmup_end_s), None)
    tail = [s[field] for s in series if s["t_s"] >= (1 - TAIL_SHARE) * end]
    if at is None or at["t_s"] >= (1 - TAIL_SHARE) * end:
        return {"pct": None, "why": f"warm-up ended at {warmup_end_s:.1f} s, inside the last 10% of {end:.1f} s"}
    base, top = at[field], max(tail)
    return {
        "pct": round((top - base) / base * 100, 3),
        "at_warmup_end": base,
        "max_last_tenth": top,
        "warmup_sample_s": at["t_s"],
    }


def _slope_per_hour(series: list[dict[str, Any]], field: str, after_s: float | None) -> float | None:
    pts = [(s["t_s"], s[field]) for s in series if after_s is not None and s["t_s"] >= after_s]
    if len(pts) < 3:
        return None
    t, v = np.array(pts, dtype=float).T
    return round(float(np.polyfit(t, v, 1)[0]) * 3600 / 2**20, 3)  # MiB per hour


class Soak:
    """One soak run in this process. ``on_record(value)`` sees every record's bytes (the tests'
    oracle replays them)."""

    def __init__(
        self,
        duration_s: float,
        rate: float,
        workers: int,
        holder_blocks: int,
        qps: float = 200,
        clear_every_s: float = 60,
        sample_s: float = 10,
        seed: int = 0,
        events_per_record: int = EVENTS_PER_RECORD,
        tick_s: float = 0.01,
        on_record: Callable[[bytes], None] | None = None,
    ):
        from kvwire.consumer.apply import Applier

        self.duration_s, self.rate, self.qps = float(duration_s), float(rate), float(qps)
        self.clear_every_s, self.sample_s, self.tick_s = float(clear_every_s), float(sample_s), float(tick_s)
        self.capacity = holder_blocks // workers
        self.fleet = Fleet(workers, self.capacity, seed, events_per_record)
        self.applier = Applier()
        self.index = self.applier.index
        self.on_record = on_record
        self.params = {
            "duration_s": self.duration_s,
            "rate_blocks_per_s": self.rate,
            "workers": workers,
            "pool_blocks_per_worker": self.capacity,
            "holder_blocks": self.capacity * workers,
            "score_qps": self.qps,
            "clear_every_s": self.clear_every_s,
            "sample_s": self.sample_s,
            "events_per_record": events_per_record,
            "block_size": self.fleet.BS,
            "conversation_blocks": self.fleet.CONV,
            "system_prompt_blocks": self.fleet.SYS,
            "system_prompts": self.fleet.N_SYS,
            "seed": seed,
        }
        self.series: list[dict[str, Any]] = []
        self.stored = self.removed = self.records = 0
        self._recs: list[_Record] = []
        self._qrng = np.random.default_rng(seed + 1)
        self._q = 0
        # Preallocated and written through once, so that the harness's own samples are RSS before
        # warm-up ends instead of growth after it (two lists of floats grew 64 B a query: ~46 MiB/h).
        cap = int(self.duration_s * self.qps * 1.05) + 1024
        self.score_wall_us = np.full(cap, np.nan)
        self.score_cpu_us = np.full(cap, np.nan)
        self.n_scores = 0
        self.recent_hits = self.recent_queries = 0
        self.queries_skipped = 0

    # ------------------------------------------------------------ the loop's parts

    def _emit(self, key: bytes, value: bytes) -> None:
        self._recs.append(_Record(self.records, key, value))
        self.records += 1
        if self.on_record is not None:
            self.on_record(value)

    def _flush(self) -> None:
        recs, i = self._recs, 0
        while i < len(recs):
            i = self.applier.apply_records("soak", 0, recs, i)
        self._recs = []

    def _query(self) -> None:
        f, i = self.fleet, self._q
        self._q += 1
        n = f.CONV * f.BS
        kind = i % 3
        if kind == 0 and f.recent:
            q = f.recent[-1 - (i // 3) % len(f.recent)]
        elif kind == 1:
            s = f.sys_tokens[i % f.N_SYS]
            q = np.concatenate([s, self._qrng.integers(0, 128_000, n - len(s), dtype=np.uint32)])
        else:
            q = self._qrng.integers(0, 128_000, n, dtype=np.uint32)
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        r = self.index.score_arrays(q, top_k=16)
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if (j := self.n_scores) < len(self.score_wall_us):
            self.score_wall_us[j] = (t1 - t0) / 1e3
            self.score_cpu_us[j] = (c1 - c0) / 1e3
            self.n_scores += 1
        if kind == 0 and f.recent:
            self.recent_queries += 1
            self.recent_hits += int(len(r.matched_tokens) > 0 and int(r.matched_tokens.max()) > f.SYS * f.BS)

    def _sample(self, t: float) -> None:
        st = proc_status()
        self.series.append(
            {
                "t_s": round(t, 3),
                "rss_anon_bytes": st["RssAnon"],
                "vm_rss_bytes": st["VmRSS"],
                "index_nbytes": self.index.nbytes(),
                "holder_blocks": len(self.index),
                "pool_blocks": self.fleet.held(),
                "engine_entries": self.index.entries(),
                "stored_blocks": self.stored,
                "removed_blocks": self.removed,
                "score_queries": self.n_scores,
                "load_avg_1m": round(os.getloadavg()[0], 2),
            }
        )

    # ------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        f, n_w = self.fleet, len(self.fleet.engines)
        load0 = list(os.getloadavg())
        cpu0 = time.process_time()
        t0 = time.monotonic()
        now = lambda: time.monotonic() - t0
        next_sample = next_q = 0.0
        next_clear = self.clear_every_s if self.clear_every_s > 0 else float("inf")
        w = cleared = 0
        pools_full_s: float | None = None
        max_behind_s = 0.0
        while (t := now()) < self.duration_s:
            target = self.rate * min(self.duration_s, t + self.tick_s)
            max_behind_s = max(max_behind_s, t - self.stored / self.rate)
            while self.stored < target:
                e = f.engines[w]
                value, ns, nr = f.next_record(w)
                self._emit(e.key, value)
                self.stored += ns
                self.removed += nr
                w = (w + 1) % n_w
                if len(self._recs) >= 256:
                    self._flush()
            self._flush()
            if pools_full_s is None and f.filled == n_w:
                pools_full_s = now()
            if t >= next_clear:
                c = cleared % n_w
                self._emit(f.engines[c].key, f.clear(c))
                self._flush()
                cleared += 1
                next_clear += self.clear_every_s
            if self.qps > 0:
                if next_q < t - 1.0:  # more than a second behind: skip, do not pile up
                    missed = int((t - 1.0 - next_q) * self.qps)
                    self.queries_skipped += missed
                    next_q += missed / self.qps
                while next_q <= now():
                    self._query()
                    next_q += 1 / self.qps
            if t >= next_sample:
                self._sample(now())
                next_sample += self.sample_s
            wake = min(self.stored / self.rate - self.tick_s, next_q if self.qps > 0 else 1e18, next_sample, next_clear)
            if (d := min(wake, self.duration_s) - now()) > 0:
                time.sleep(d)
        self._flush()
        t_end = now()
        cpu_s = time.process_time() - cpu0
        self._sample(t_end)
        load1 = list(os.getloadavg())
        warm = None if pools_full_s is None else max(WARMUP_SHARE * t_end, pools_full_s)
        rss = growth(self.series, "rss_anon_bytes", warm)
        own = growth(self.series, "index_nbytes", warm)
        at_warm = next((s for s in self.series if warm is not None and s["t_s"] >= warm), None)
        end = self.series[-1]
        res: dict[str, Any] = {
            "what": (
                "RSS of one index process under steady churn: a fleet of engines with fixed LRU block pools storing "
                "new conversations and removing what their pools evict, real Avro records through "
                "Applier.apply_records, score queries beside; growth after warm-up"
            ),
            "params": self.params,
            "soak_rss_growth_pct": rss["pct"],
            "index_nbytes_growth_pct": own["pct"],
            "rss_anon": rss,
            "index_nbytes": own,
            "rss_slope_mib_per_hour_after_warmup": _slope_per_hour(self.series, "rss_anon_bytes", warm),
            "index_nbytes_slope_mib_per_hour_after_warmup": _slope_per_hour(self.series, "index_nbytes", warm),
            "warmup_end_s": None if warm is None else round(warm, 3),
            "pools_full_s": None if pools_full_s is None else round(pools_full_s, 3),
            "duration_s": round(t_end, 3),
            "holder_blocks_start": None if at_warm is None else at_warm["holder_blocks"],
            "holder_blocks_end": end["holder_blocks"],
            "pool_blocks_end": end["pool_blocks"],
            "stored_blocks": self.stored,
            "removed_blocks": self.removed,
            "records": self.records,
            "achieved_stored_blocks_per_s": round(self.stored / t_end),
            "achieved_removed_blocks_per_s": round(self.removed / t_end),
            "achieved_over_offered": round(self.stored / t_end / self.rate, 4),
            "max_behind_schedule_s": round(max_behind_s, 3),
            "clears": f.clears,
            "dead_letters": len(self.applier.dead_letters),
            "score_queries": self.n_scores,
            "score_queries_skipped": self.queries_skipped,
            "achieved_score_qps": round(self.n_scores / t_end, 1),
            "score_us": {
                "wall": {
                    k: round(v, 1)
                    for k, v in percentiles(self.score_wall_us[: self.n_scores].tolist(), (50, 99)).items()
                    if v is not None
                },
                "cpu": {
                    k: round(v, 1)
                    for k, v in percentiles(self.score_cpu_us[: self.n_scores].tolist(), (50, 99)).items()
                    if v is not None
                },
            },
            "recent_conversation_hit_share": (
                round(self.recent_hits / self.recent_queries, 3) if self.recent_queries else None
            ),
            "process_cpu_s": round(cpu_s, 1),
            "process_cpu_share": round(cpu_s / t_end, 3),
            "load_avg": {"start": load0, "end": load1},
            "cpus": os.cpu_count(),
            "series": self.series,
        }
        if rss["pct"] is None:
            res["growth_note"] = rss["why"]
        return res


def _core_info() -> dict[str, Any]:
    from kvwire import _core

    path = Path(_core.__file__ or "")
    digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None
    return {"core": str(path), "core_sha256": digest}


def run(**kw: Any) -> dict[str, Any]:
    res = Soak(**kw).run()
    res["params"].update(_core_info())
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="60 s at 500k holder-blocks")
    g.add_argument("--smoke", action="store_true", help="3 s, 8 workers, 16k holder-blocks (tests)")
    ap.add_argument("--duration-s", type=float, default=None, help="default 1800")
    ap.add_argument("--rate", type=float, default=None, help="offered stored blocks/s (default 100000)")
    ap.add_argument("--workers", type=int, default=None, help="default 64")
    ap.add_argument("--holder-blocks", type=int, default=None, help="what the full pools hold (default 2000000)")
    ap.add_argument("--qps", type=float, default=None, help="score queries/s (default 200)")
    ap.add_argument("--clear-every-s", type=float, default=None, help="one worker's AllBlocksCleared (default 60)")
    ap.add_argument("--sample-s", type=float, default=None, help="seconds between samples (default 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--core", default=None, help="load kvwire._core from this copy of the .so")
    ap.add_argument("--no-plot", action="store_true", help="write the JSON only")
    a = ap.parse_args(argv)
    if a.core:
        from .ab_core import _load_core

        _load_core(str(Path(a.core).resolve()))
    mode = "smoke" if a.smoke else "quick" if a.quick else "full"
    kw: dict[str, Any] = dict(PRESETS[mode])
    for k in kw:
        if getattr(a, k) is not None:
            kw[k] = getattr(a, k)
    kw["workers"], kw["holder_blocks"] = int(kw["workers"]), int(kw["holder_blocks"])
    print(f"soak ({mode}): {kw}", flush=True)
    res = run(**kw, seed=a.seed)
    res["params"]["mode"] = mode
    path = write_result("soak", res)
    g_ = res["index_nbytes"]
    print(
        f"soak: RssAnon growth {res['soak_rss_growth_pct']}% after warm-up ({res['warmup_end_s']} s; "
        f"{res.get('growth_note', 'ok')}), index nbytes growth {g_['pct']}%, "
        f"{res['achieved_stored_blocks_per_s']:,} stored + {res['achieved_removed_blocks_per_s']:,} removed blocks/s "
        f"(offered {kw['rate']:,.0f}), holder-blocks {res['holder_blocks_start']} -> {res['holder_blocks_end']}, "
        f"load average {res['load_avg']['end'][0]:.2f}",
        flush=True,
    )
    print("wrote", path)
    if not a.no_plot:
        from .plots import plot_soak

        print("wrote", plot_soak(path.parent, res))


if __name__ == "__main__":
    main()
