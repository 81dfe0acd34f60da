"""What publishing costs the engine thread: kvwire's RankStream.publish() beside vLLM's pattern.

Four runs on the same realistic batch (one BlockStored of one 16-token block, an unsigned
64-bit engine hash), each timing every call with perf_counter_ns:

- kvwire, Kafka up (a real broker; KAFKA_BOOTSTRAP_SERVERS or kvwire's local one);
- kvwire, Kafka down (bootstrap at a closed port: the buffer fills, then batches drop);
- a noise floor: the same driver around a trivial locked deque append;
- vLLM's pattern: a blocking ``queue.Queue(maxsize).put`` drained by a consumer thread that
  encodes with msgspec and then waits a fixed per-batch send time (``--consumer-us``) — slower than
  the engine, as a ZMQ socket behind a slow subscriber or a stalled network is.

The engine publishes in bursts with a sleep between them (an engine publishes once per step and
releases the GIL while the GPU runs); the buffer is the same size in every run.

    python -m bench.publish_cost [--quick] [--calls N]

Writes bench/results/publish_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import socket
import threading
import time
import uuid

import msgspec

from kvwire.schemas.events import WorkerId, stored

from .common import percentiles, write_result

PS = (50, 99, 99.9)


def realistic_batch(i: int):
    # Hash >= 2^63 on purpose: vLLM's default unsigned form.
    return [
        stored(
            [(1 << 63) + i * 2654435761 % (1 << 62)], range(i % 1000, i % 1000 + 16), 16, (1 << 63) + i, medium="GPU"
        )
    ]


def drive(call, calls: int, burst: int, pause_s: float) -> tuple[list[int], int]:
    """Times every call; returns (ns samples, calls that returned False)."""
    batches = [realistic_batch(i) for i in range(256)]
    samples = [0] * calls
    refused = 0
    clock = time.perf_counter_ns
    for i in range(calls):
        ev = batches[i & 255]
        t0 = clock()
        ok = call(ev)
        samples[i] = clock() - t0
        if ok is False:
            refused += 1
        if i % burst == burst - 1:
            time.sleep(pause_s)
    return samples, refused


def summarize(samples: list[int]) -> dict:
    out = {k: (v / 1000 if v is not None else None) for k, v in percentiles(samples, PS).items()}
    out["max"] = max(samples) / 1000
    out["mean"] = sum(samples) / len(samples) / 1000
    return out  # microseconds


def run_kvwire(bootstrap: str, calls: int, burst: int, pause_s: float, queue_size: int, down: bool) -> dict:
    from kvwire.producer.publisher import KafkaPublisher, PublisherConfig

    cfg = PublisherConfig(
        bootstrap_servers=bootstrap,
        topic=f"bench-publish-{uuid.uuid4().hex[:8]}",
        partitions=1,
        queue_size=queue_size,
        heartbeat_interval_s=3600,
        unreachable_timeout_s=1.0 if down else 30.0,
        retry_backoff_s=0.1,
    )
    pub = KafkaPublisher(cfg)
    try:
        st = pub.stream(WorkerId("bench", 0), source="bench")
        if not down:  # measure steady state, not the connection handshake
            deadline = time.monotonic() + 60
            while st.stats().acked < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        t0 = time.perf_counter()
        samples, refused = drive(st.publish, calls, burst, pause_s)
        wall = time.perf_counter() - t0
    finally:
        pub.close(timeout=30 if not down else 1)
    s = st.stats()
    return {
        **summarize(samples),
        "calls": calls,
        "refused": refused,
        "wall_s": round(wall, 3),
        "acked": s.acked,
        "dropped": s.dropped,
        "gap_sent": s.gap_sent,
    }


def run_blocking_queue(calls: int, burst: int, pause_s: float, maxsize: int, consumer_us: float) -> dict:
    """vLLM ZmqEventPublisher.publish(): Queue.put on the engine thread, blocking when full."""
    q: queue.Queue = queue.Queue(maxsize=maxsize)
    enc = msgspec.msgpack.Encoder()
    stop = object()

    def consumer() -> None:
        pause = consumer_us / 1e6
        while True:
            item = q.get()
            if item is stop:
                return
            enc.encode(
                [time.time(), [{**msgspec.structs.asdict(e), "token_ids": e.token_ids.tolist()} for e in item], 0]
            )
            time.sleep(pause)  # the send to a slow subscriber; like a socket, it frees the GIL

    t = threading.Thread(target=consumer, daemon=True)
    t.start()
    t0 = time.perf_counter()
    samples, _ = drive(q.put, calls, burst, pause_s)
    wall = time.perf_counter() - t0
    q.put(stop)
    t.join()
    return {
        **summarize(samples),
        "calls": calls,
        "refused": 0,
        "wall_s": round(wall, 3),
        "queue_maxsize": maxsize,
        "consumer_us_per_batch": consumer_us,
    }


def run_floor(calls: int, burst: int, pause_s: float) -> dict:
    """The machine's noise floor: the same driver around a trivial locked deque append. On a
    small VM the first call after a pause and the p99.9 are dominated by this, not by kvwire."""
    import collections

    d: collections.deque = collections.deque(maxlen=1024)
    lock = threading.Lock()

    def trivial(ev) -> bool:
        with lock:
            d.append(ev)
        return True

    t0 = time.perf_counter()
    samples, _ = drive(trivial, calls, burst, pause_s)
    wall = time.perf_counter() - t0
    return {**summarize(samples), "calls": calls, "refused": 0, "wall_s": round(wall, 3)}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="50k calls per run (< 60 s)")
    ap.add_argument("--calls", type=int, default=None)
    ap.add_argument("--burst", type=int, default=64, help="calls between engine pauses")
    ap.add_argument("--pause-ms", type=float, default=2.0)
    ap.add_argument("--queue-size", type=int, default=10_000)
    ap.add_argument("--consumer-us", type=float, default=100.0)
    ap.add_argument("--bootstrap", default=os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the Kafka-down run is meant to fail
    calls = args.calls or (50_000 if args.quick else 200_000)
    pause = args.pause_ms / 1000
    bootstrap = args.bootstrap
    if not bootstrap:
        from kvwire.kafka.broker import resolve_bootstrap

        bootstrap = resolve_bootstrap()

    runs = {
        "noise_floor_deque_append": run_floor(calls, args.burst, pause),
        "kvwire_kafka_up": run_kvwire(bootstrap, calls, args.burst, pause, args.queue_size, False),
        "kvwire_kafka_down": run_kvwire(f"127.0.0.1:{closed_port()}", calls, args.burst, pause, args.queue_size, True),
        "vllm_blocking_queue_put": run_blocking_queue(calls, args.burst, pause, args.queue_size, args.consumer_us),
    }
    base = runs["vllm_blocking_queue_put"]
    ratios = {
        name: {p: (round(base[p] / r[p], 1) if r[p] else None) for p in ("p50", "p99", "p99.9", "max")}
        for name, r in runs.items()
        if name.startswith("kvwire")
    }
    result = {
        "what": "engine-thread cost of one publish() call, microseconds",
        "params": {
            "calls": calls,
            "burst": args.burst,
            "pause_ms": args.pause_ms,
            "queue_size": args.queue_size,
            "consumer_us": args.consumer_us,
            "batch": "1 BlockStored, 1 block of 16 tokens, u64 hash >= 2^63",
        },
        "runs": runs,
        "engine_pause_s": round(calls // args.burst * pause, 3),
        "blocking_over_kvwire": ratios,
    }
    path = write_result("publish_cost", result)
    hdr = f"{'run':<26}{'p50':>9}{'p99':>9}{'p99.9':>9}{'max':>11}{'refused':>9}{'wall_s':>9}"
    print(hdr)
    print("-" * len(hdr))
    for name, r in runs.items():
        print(
            f"{name:<26}{r['p50']:>9.2f}{r['p99']:>9.2f}{r['p99.9']:>9.2f}{r['max']:>11.1f}"
            f"{r['refused']:>9}{r['wall_s']:>9.2f}"
        )
    print(
        f"(microseconds per call; wall_s = engine loop time, {calls // args.burst * pause:.2f} s of it "
        "pauses: the excess is time the engine thread waited, mostly for the GIL)"
    )
    for name, rr in ratios.items():
        print(f"queue.put / {name}: " + ", ".join(f"{p} {v}x" for p, v in rr.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
