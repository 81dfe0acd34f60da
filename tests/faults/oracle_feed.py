"""Shared by the fault tests: a simulated fleet publishing through the real publisher with every
acknowledgement recorded, the log read back, and the oracle built from exactly the acknowledged
records — what the index must equal once a fault is over.

Why acknowledged records and not what the simulator published: a fault may legitimately lose
records the producer never had acknowledged (they are then owned up to as gaps); an acknowledged
record, though, must survive every fault, so "acked lost" is counted separately and must be 0.

The oracle is ``tests/oracle.py`` (brute force, independent of the index) plus a reference
``PrefixIndex`` fed the very same calls, whose ``digest()`` is what a member's /v1/digest must say.
Fencing here is deliberately simpler than ``kvwire.consumer.rank_state``: acknowledged records of one
rank arrive in the producer's order, so a reset clears the rank and a gap (or a seq hole) makes
it untrusted until the next reset or AllBlocksCleared of that rank; the epochs must appear in the
order the driver created them.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from oracle import Oracle

from kvwire.consumer.index import PrefixIndex
from kvwire.kafka.positions import seek_to_beginning
from kvwire.producer.publisher import AckInfo, KafkaPublisher, PublisherConfig
from kvwire.producer.simulator import SimConfig, Simulator
from kvwire.schemas import codec
from kvwire.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, WorkerId

# A test run never writes into the tracked tree: measurements go to a temp file unless the fault
# benchmark (`python -m bench.faults`) points KVWIRE_FAULT_RESULTS at bench/results/faults.json.
RESULTS = Path(os.environ.get("KVWIRE_FAULT_RESULTS") or Path(tempfile.gettempdir()) / "kvwire-faults.json")
_results_lock = threading.Lock()


# ---------------------------------------------------------------- results


def record_result(fault: str, **values: Any) -> None:
    """Print one fault's measurements and merge them into bench/results/faults.json."""
    values = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in values.items()}
    print(f"\n[faults] {fault}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    with _results_lock:
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(RESULTS.read_text())
        except (OSError, ValueError):
            data = {}
        entry = data.get(fault, {})
        entry.update(values)
        entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        data[fault] = entry
        tmp = RESULTS.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, RESULTS)


# ---------------------------------------------------------------- waiting


async def wait_until(pred: Callable[[], Any], timeout: float, what: str, every: float = 0.1) -> float:
    """Poll ``pred`` (sync or async) until truthy; returns the seconds it took. The timeout only
    guards against a hang: no test asserts on the time itself."""
    t0 = time.monotonic()
    last = None
    while True:
        try:
            r = pred()
            if asyncio.iscoroutine(r):
                r = await r
            if r:
                return time.monotonic() - t0
        except Exception as e:  # e.g. a member's HTTP port not open yet
            last = e
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last error: {last!r})")
        await asyncio.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- the fleet


class Fleet:
    """Simulator -> KafkaPublisher with every ack recorded. The simulator is not thread-safe:
    drive it either with ``run`` or with the background driver, never both at once."""

    def __init__(
        self, bootstrap: str, topic: str, partitions: int, *, sim: dict | None = None, pub: dict | None = None
    ) -> None:
        self.acks: list[AckInfo] = []  # list.append is atomic; the publisher thread appends
        cfg = {
            "linger_ms": 1,
            "queue_size": 100_000,
            "unreachable_timeout_s": 300.0,
            "retry_backoff_s": 0.1,
            **(pub or {}),
        }
        self.pub = KafkaPublisher(
            PublisherConfig(bootstrap_servers=bootstrap, topic=topic, partitions=partitions, **cfg),
            on_ack=self.acks.append,
        )
        self.topic = topic
        self.bootstrap = bootstrap
        self.streams = {}
        self.epochs: dict[tuple, list[int]] = defaultdict(list)  # rank -> epochs, oldest first
        scfg = {"workers": 6, "capacity_blocks": 150, "p_clear": 0.01, "p_restart": 0.005, "seed": 7, **(sim or {})}
        self.sim = Simulator(SimConfig(**scfg), self._sink, on_restart=self._restart)
        for ranks in self.sim.ranks:
            for r in ranks:
                st = self.pub.stream(r, "simulator")
                self.streams[r] = st
                self.epochs[r.rank].append(st.epoch)
        self.refused = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps_run = 0

    def _sink(self, rank: WorkerId, events) -> None:
        if not self.streams[rank].publish(events):
            self.refused += 1

    def _restart(self, rank: WorkerId) -> None:
        self.epochs[rank.rank].append(self.streams[rank].new_epoch())

    def run(self, steps: int) -> None:
        for _ in range(steps):
            self.sim.step()
            self.steps_run += 1

    def start(self, pace_s: float = 0.002) -> None:
        """Keep the fleet busy in a thread (the engine side) until ``stop``."""

        def drive() -> None:
            while not self._stop.is_set():
                self.sim.step()
                self.steps_run += 1
                self._stop.wait(pace_s)

        self._stop.clear()
        self._thread = threading.Thread(target=drive, name="fleet", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def in_flight(self) -> int:
        """Records accepted but not yet acknowledged: queued plus sent-and-unacked."""
        return sum(s.queued + s.sent - s.acked - s.failed for s in self.pub.stats())

    def close(self, timeout: float = 60.0):
        self.stop()
        self.pub.close(timeout=timeout)
        return self.pub.stats()

    def acked_count(self) -> int:
        return len(self.acks)


# ---------------------------------------------------------------- the log


@dataclass(frozen=True)
class LogRecord:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


async def read_log(bootstrap: str, topic: str, client_options: dict | None = None) -> list[LogRecord]:
    """Every record of ``topic`` up to the end offsets seen now, in partition/offset order."""
    c = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest", **(client_options or {})
    )
    await c.start()
    try:
        parts = c.partitions_for_topic(topic)
        for _ in range(100):
            if parts:
                break
            await c._client.force_metadata_update()  # a topic just created may be unknown yet
            parts = c.partitions_for_topic(topic)
            await asyncio.sleep(0.1)
        tps = [TopicPartition(topic, p) for p in sorted(parts or ())]
        c.assign(tps)
        ends = await c.end_offsets(tps)
        await seek_to_beginning(c, *tps)
        out: list[LogRecord] = []
        todo = {tp for tp in tps if ends[tp] > 0}
        while todo:
            for tp, recs in (await c.getmany(*todo, timeout_ms=1000)).items():
                out.extend(LogRecord(tp.partition, r.offset, r.key, r.value) for r in recs)
            for tp in list(todo):
                if await c.position(tp) >= ends[tp]:
                    todo.discard(tp)
        out.sort(key=lambda r: (r.partition, r.offset))
        return [r for r in out if r.offset < ends[TopicPartition(topic, r.partition)]]
    finally:
        await c.stop()


async def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await c.start()
    try:
        parts = c.partitions_for_topic(topic) or set()
        if not parts:
            await c._client.force_metadata_update()
            parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in parts]
        return {tp.partition: off for tp, off in (await c.end_offsets(tps)).items()}
    finally:
        await c.stop()


async def committed_offsets(bootstrap: str, topic: str, group: str) -> dict[int, int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        got = await admin.list_consumer_group_offsets(group)
        return {tp.partition: om.offset for tp, om in got.items() if tp.topic == topic and om.offset >= 0}
    finally:
        await admin.close()


# ---------------------------------------------------------------- the oracle


@dataclass
class Expected:
    oracle: Oracle
    ref: PrefixIndex
    untrusted: set[tuple[str, int]]
    workers: set[tuple[str, int]]
    acked_records: int
    acked_lost: int  # acknowledged, yet not in the log as acknowledged
    duplicates: int  # one (rank, epoch, seq) at two offsets
    notes: list[str] = field(default_factory=list)

    def holder_blocks(self) -> dict:
        return {k: v for k, v in self.oracle.holder_blocks().items() if v}

    def blocks_per_worker(self) -> dict[tuple[str, int], int]:
        out: dict = defaultdict(int)
        for (w, _m), keys in self.holder_blocks().items():
            out[w] += len(keys)
        return dict(out)

    def score(self, tokens, **kw) -> list[tuple]:
        """(instance_id, dp_rank, matched_tokens, score) of trusted workers, best first."""
        return [
            (s.instance_id, s.dp_rank, s.matched_tokens, s.score)
            for s in self.oracle.score(tokens, **kw)
            if (s.instance_id, s.dp_rank) not in self.untrusted
        ]

    def digest(self) -> str:
        return self.ref.digest()


def build_expected(
    records: list[LogRecord], acks: list[AckInfo], epochs: dict[tuple, list[int]] | None = None
) -> Expected:
    """Feed the oracle the acknowledged records, in log order."""
    by_pos = {(r.partition, r.offset): r for r in records}
    acked = {}
    lost = 0
    for a in acks:
        r = by_pos.get((a.partition, a.offset))
        b = None
        if r is not None and r.value is not None:
            try:
                b = codec.decode(r.value)
            except codec.DecodeError:
                b = None
        if b is None or (b.worker.rank, b.epoch, b.seq) != (a.worker.rank, a.epoch, a.seq):
            lost += 1
            continue
        acked[(a.partition, a.offset)] = b
    # A producer retry that the broker failed to dedup lands as a byte-identical copy elsewhere.
    acked_values = {by_pos[pos].value for pos in acked}
    dups = sum(1 for r in records if (r.partition, r.offset) not in acked and r.value in acked_values)

    o, ref = Oracle(), PrefixIndex()
    state: dict[tuple, dict] = {}
    notes: list[str] = []
    for pos in sorted(acked):
        b = acked[pos]
        rank = b.worker
        st = state.get(rank.rank)
        if epochs is not None:
            order = epochs.get(rank.rank, [])
            assert b.epoch in order, f"{rank.rank}: epoch {b.epoch} was never created by the driver"
            if st is not None and order.index(b.epoch) < order.index(st["epoch"]):
                raise AssertionError(f"{rank.rank}: acked record of an older epoch after a newer one")
        if st is None or b.epoch != st["epoch"] or b.reset:
            if not b.reset:
                notes.append(f"{rank.rank}: epoch {b.epoch} began without its reset record")
            st = state[rank.rank] = {"epoch": b.epoch, "seq": b.seq, "trusted": b.reset and not b.gap}
            o.clear(rank)
            ref.clear(rank)
        else:
            if b.seq != st["seq"] + 1 or b.gap:
                st["trusted"] = False
            st["seq"] = b.seq
        for ev in b.events:
            t = type(ev)
            if t is BlockStored:
                o.store(rank, ev)
                ref.store(rank, ev)
            elif t is BlockRemoved:
                o.remove(rank, ev)
                ref.remove(rank, ev)
            elif t is AllBlocksCleared:
                o.clear(rank)
                ref.clear(rank)
                st["trusted"] = True  # its state is known again: empty (a gap it carried came before)
    workers = {r[:2] for r in state}
    tp = {w: n for w, n in o.tp.items()}
    untrusted = set()
    for w in workers:
        ranks = [s for r, s in state.items() if r[:2] == w]
        if len(ranks) < tp.get(w, 1) or not all(s["trusted"] for s in ranks):
            untrusted.add(w)
    assert {k: v for k, v in ref.holder_blocks().items() if v} == {k: v for k, v in o.holder_blocks().items() if v}, (
        "reference index and brute-force oracle disagree on the same input"
    )
    return Expected(o, ref, untrusted, workers, len(acked), lost, dups, notes)


def diff_index(index: PrefixIndex, exp: Expected, workers: set | None = None) -> str | None:
    """None when the index holds exactly the oracle's holder-blocks (restricted to ``workers``)."""
    got = {k: v for k, v in index.holder_blocks().items() if v and (workers is None or k[0] in workers)}
    want = {k: v for k, v in exp.holder_blocks().items() if workers is None or k[0] in workers}
    if got == want:
        return None
    keys = sorted(set(got) | set(want))
    bad = [(k, len(got.get(k, ())), len(want.get(k, ()))) for k in keys if got.get(k) != want.get(k)]
    return f"{len(bad)} (worker, medium) differ, (key, index, oracle): {bad[:5]}"


def diff_union(indexes: list[PrefixIndex], exp: Expected) -> str | None:
    """Shared-group mode: the members' holder-blocks, disjoint by worker, union to the oracle."""
    union: dict = {}
    for idx in indexes:
        for k, v in idx.holder_blocks().items():
            if not v:
                continue
            if k in union:
                return f"{k} held by two members"
            union[k] = v
    want = exp.holder_blocks()
    if union == want:
        return None
    bad = [k for k in sorted(set(union) | set(want)) if union.get(k) != want.get(k)]
    return f"{len(bad)} (worker, medium) differ: {bad[:5]}"


def score_requests(sim: Simulator, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts to score: next turns of the fleet's sessions (plus truncations), without
    changing any cache."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        toks = list(sim.next_request().token_ids)
        if rng.random() < 0.3:
            toks = toks[: rng.randrange(len(toks) + 1)]
        out.append(toks)
    return out


def assert_scores(score_fn: Callable[[list[int]], list[tuple]], exp: Expected, prompts: list[list[int]]) -> None:
    for toks in prompts:
        got = score_fn(toks)
        want = exp.score(toks)
        assert got == want, f"score of a {len(toks)}-token prompt: index {got[:4]} oracle {want[:4]}"


def applier_scores(applier) -> Callable[[list[int]], list[tuple]]:
    return lambda toks: [(s.instance_id, s.dp_rank, s.matched_tokens, s.score) for s in applier.score(toks)]


def sim_blocks(sim: Simulator) -> dict[tuple[str, int], int]:
    """The engines' own view: blocks each worker holds now (equals the oracle when nothing
    published was lost)."""
    return {w: len(sim.caches[i]) for i, w in enumerate(sim.workers) if sim.caches[i]}
