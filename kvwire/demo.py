"""`kvwire demo`: the whole pipeline on one machine.

Simulated vLLM workers (paged caches, LRU eviction, shared system prompts,
multi-turn sessions, restarts) publish their KV events through kvwire's
producer into a real Kafka topic; index members in one consumer group each
index their partitions; a router scores every request over the members
(scatter-gather), sends it to the worker with the longest cached prefix, and
that worker serves it — so the index's answers drive the fleet. Every routing
decision is checked against an oracle: the simulator's true caches.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import typer

from kvwire.cli_failure import kafka_client_options, one_line, reaching_kafka
from kvwire.cli_options import KafkaConfig, OptionalBootstrap


@dataclass(frozen=True)
class DemoOptions:
    """`kvwire demo` as parsed, with the broker found or started."""

    bootstrap_servers: str
    workers: int
    tp_size: int
    partitions: int
    members: int
    seconds: float
    rate: float
    capacity: int
    seed: int
    client_options: Any  # kvwire.kafka.options.ClientOptions (repr redacted)


@dataclass
class DemoStats:
    requests: int = 0
    hits: int = 0  # routed to a worker holding the longest cached prefix there was
    cold: int = 0  # nobody held any of the prompt
    routed_tokens: int = 0  # prefix tokens the chosen worker really held
    best_tokens: int = 0  # prefix tokens the best worker held
    rr_tokens: int = 0  # what round-robin routing would have reused
    restarts: int = 0
    clears: int = 0


def demo(
    workers: int = typer.Option(8, help="Simulated engine workers"),
    tp_size: int = typer.Option(
        1, "--tp-size", help="Tensor-parallel ranks per worker (each publishes its own stream)"
    ),
    partitions: int = typer.Option(8, help="Partitions of the demo topic"),
    members: int = typer.Option(2, help="Index members in the consumer group"),
    seconds: float = typer.Option(20.0, help="How long to route requests"),
    rate: float = typer.Option(150.0, help="Requests per second offered"),
    capacity: int = typer.Option(400, help="Cache capacity per worker, in blocks of 16 tokens"),
    seed: int = typer.Option(0),
    bootstrap_servers: OptionalBootstrap = None,
    kafka_config: KafkaConfig = None,
) -> None:
    """Run simulated workers → producer → Kafka → index group → router, and report hit rate against an oracle."""
    from rich.console import Console

    # soft_wrap: a summary line stays one line in a log or a pipe, whatever the terminal width.
    console = Console(stderr=False, soft_wrap=True)
    log_path = _quiet_libraries()
    if not bootstrap_servers:
        from kvwire.kafka.broker import default_port, resolve_bootstrap
        from kvwire.kafka.broker.probe import answers

        local = f"127.0.0.1:{default_port()}"
        if answers(local, timeout_s=3.0):
            bootstrap_servers = local
            console.print("[dim]using the local Kafka that is already running[/]")
        else:
            console.print("[dim]starting Kafka (first run downloads the broker jars with Maven)...[/]")
            bootstrap_servers = resolve_bootstrap()
    with one_line("demo"):
        opts = DemoOptions(
            bootstrap_servers,
            workers,
            tp_size,
            partitions,
            members,
            seconds,
            rate,
            capacity,
            seed,
            kafka_client_options(kafka_config),
        )
        ok = asyncio.run(_run(console, opts))
    warnings = _count_warnings(log_path)
    if warnings:
        console.print(f"[dim]{warnings} library warning(s) (consumer-group rebalancing, ...) in {log_path}[/]")
    raise typer.Exit(0 if ok else 1)


def _quiet_libraries() -> str:
    """Library log lines (aiokafka's group coordinator warns through every rebalance) go to a file,
    so the progress lines stay readable; the summary says where they went."""
    import logging
    import os
    import tempfile

    fd, path = tempfile.mkstemp(prefix="kvwire-demo-", suffix=".log")
    os.close(fd)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    return path


def _count_warnings(path: str) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if " WARNING " in line or " ERROR " in line)
    except OSError:
        return 0


async def _run(console, o: DemoOptions) -> bool:
    from kvwire.consumer.http import merge_scores
    from kvwire.consumer.ingest import IndexMember, IngestConfig
    from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
    from kvwire.producer.simulator import SimConfig, Simulator

    bootstrap, partitions, opts = o.bootstrap_servers, o.partitions, o.client_options
    n_workers, n_members = o.workers, o.members
    topic = f"kvwire.demo-{uuid.uuid4().hex[:8]}"
    # The topic first: it is the demo's first contact with the broker, and the publisher
    # (which retries an outage for ever, as an engine's must) only starts once it answered.
    with reaching_kafka(bootstrap):
        await _create_topic(bootstrap, topic, partitions, opts)
    console.print(f"Kafka: [bold]{bootstrap}[/]")
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=bootstrap, topic=topic, partitions=partitions, linger_ms=2, client_options=opts
        )
    )
    streams: dict[Any, Any] = {}
    sim = Simulator(
        SimConfig(
            workers=n_workers, tp_size=o.tp_size, capacity_blocks=o.capacity, seed=o.seed, p_clear=0.0, p_restart=0.0
        ),
        lambda rank, evs: streams[rank].publish(evs),
        on_restart=lambda rank: streams[rank].new_epoch(),
    )
    console.print(
        f"topic [bold]{topic}[/] ({partitions} partitions), {n_workers} workers x TP{o.tp_size}, "
        f"{n_members} index member(s) in one group"
    )

    group = f"kvwire-demo-{uuid.uuid4().hex[:8]}"
    members = [
        IndexMember(IngestConfig(bootstrap, topic, group_id=group, heartbeat_timeout_s=3600, client_options=opts))
        for _ in range(n_members)
    ]
    for m in members:
        await m.start()
    # Wait for the group to settle: every partition owned by exactly one member, and every member
    # owning some (the first member to join takes all partitions until the others' join
    # rebalances them, so "all owned" alone is reached before the split).
    settled = False
    for _ in range(1200):
        owned = [p for m in members for p in m.assigned]
        if sorted(owned) == list(range(partitions)) and all(m.assigned for m in members[:partitions]):
            settled = True
            break
        await asyncio.sleep(0.05)
    console.print(
        "group assignment: "
        + ", ".join(f"member {i}: {sorted(m.assigned)}" for i, m in enumerate(members))
        + ("" if settled else " [yellow](the group had not settled; routing starts anyway)[/]")
    )
    for ranks in sim.ranks:  # streams start now: their first record (a reset) is not startup lag
        for r in ranks:
            streams[r] = pub.stream(r, "simulator")

    def score(tokens):
        answers = [
            [
                {
                    "instance_id": s.instance_id,
                    "dp_rank": s.dp_rank,
                    "matched_tokens": s.matched_tokens,
                    "score": s.score,
                }
                for s in m.applier.score(tokens)
            ]
            for m in members
        ]
        return merge_scores(answers, limit=8)

    st = DemoStats()
    rng = random.Random(o.seed + 1)
    index_of = {w: i for i, w in enumerate(sim.workers)}
    bs = sim.cfg.block_size
    t0 = time.perf_counter()
    next_print = t0 + 1.0
    interval = 1.0 / o.rate
    rr = 0
    while (now := time.perf_counter()) - t0 < o.seconds:
        # faults a real fleet sees: restarts (a new epoch) and cache resets
        if rng.random() < 0.002:
            w = rng.randrange(n_workers)
            sim.restart(w)
            st.restarts += 1
        elif rng.random() < 0.001:
            sim.clear(rng.randrange(n_workers))
            st.clears += 1
        req = sim.next_request()
        tokens = req.token_ids
        ranked = score(list(tokens))
        if ranked:
            target = index_of[(ranked[0]["instance_id"], ranked[0]["dp_rank"])]
        else:
            target = rng.randrange(n_workers)  # nothing cached anywhere (as far as we know)
        got = sim.prefix_blocks(target, tokens)
        st.requests += 1
        st.best_tokens += req.expected_blocks * bs
        st.routed_tokens += got * bs
        st.rr_tokens += sim.prefix_blocks(rr % n_workers, tokens) * bs
        rr += 1
        if req.expected_blocks == 0:
            st.cold += 1
        if got == req.expected_blocks:
            st.hits += 1
        sim.sessions[req.session].worker = target
        sim.serve(target, tokens)
        if now >= next_print:
            next_print += 1.0
            console.print(_line(st, members, pub, now - t0))
        await asyncio.sleep(max(0.0, t0 + st.requests * interval - time.perf_counter()))

    # drain: every accepted batch reaches the index, then compare with the engines' caches
    await asyncio.to_thread(pub.close)
    ends = await _end_offsets(bootstrap, topic, opts)
    for _ in range(600):
        pos = {p: off for m in members for p, off in m.applier.positions.items() if p in m.assigned}
        if all(pos.get(p, 0) >= off for p, off in ends.items()):
            break
        await asyncio.sleep(0.05)
    exact = 0
    for w, key in enumerate(sim.workers):
        held = 0
        for m in members:
            ws = m.applier.index.workers().get(key)
            held += sum(ws.blocks.values()) if ws is not None else 0
        exact += held == len(sim.caches[w])
    elapsed = time.perf_counter() - t0
    console.print(_line(st, members, pub, elapsed))
    lag = _lag(members)
    applied_records = sum(m.applier.records for m in members)
    applied_blocks = sum(m.applier.blocks for m in members)
    pstats = pub.stats()
    dropped = sum(s.dropped for s in pstats)
    console.rule("[bold]kvwire demo summary")
    console.print(
        f"requests routed            {st.requests} ({st.requests / elapsed:.0f}/s), {st.cold} with nothing cached anywhere"
    )
    console.print(
        f"hit rate vs oracle         [bold]{st.hits / max(1, st.requests):.2%}[/] (routed to a worker holding the longest cached prefix)"
    )
    console.print(
        f"prefix tokens reused       {st.routed_tokens} of {st.best_tokens} possible "
        f"({st.routed_tokens / max(1, st.best_tokens):.2%}); round-robin would reuse {st.rr_tokens} "
        f"({st.rr_tokens / max(1, st.best_tokens):.2%})"
    )
    # Not the pipeline's lag: here the producer, every index member and the router share one
    # process and event loop, so routing work delays applying. bench/lag.py runs each in its own.
    console.print(
        f"in-process lag             p50 {lag[0]} ms, p99 {lag[1]} ms (publish() to applied, all parts in this "
        "one process; the pipeline's lag: python -m bench.lag)"
    )
    console.print(
        f"applied                    {applied_records} records, {applied_blocks} blocks "
        f"({applied_blocks / elapsed:,.0f} blocks/s); {sum(len(m.applier.index) for m in members)} holder-blocks"
    )
    console.print(
        f"producer                   {sum(s.acked for s in pstats)} records acked, {dropped} dropped; "
        f"{st.restarts} worker restarts (new epochs), {st.clears} cache resets"
    )
    console.print(f"index == engines' caches   {exact}/{n_workers} workers exact after drain")
    for m in members:
        await m.stop()
    return exact == n_workers and dropped == 0


def _lag(members) -> tuple:
    samples = sorted(x for m in members for x in m.applier.metrics._lags)
    if not samples:
        return (None, None)
    return (
        round(samples[len(samples) // 2] / 1000, 2),
        round(samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1000, 2),
    )


def _line(st: DemoStats, members, pub, elapsed: float) -> str:
    lag = _lag(members)
    hb = sum(len(m.applier.index) for m in members)
    return (
        f"{elapsed:5.1f}s req {st.requests:6d}  hit {st.hits / max(1, st.requests):6.1%}  "
        f"reuse {st.routed_tokens / max(1, st.best_tokens):6.1%} (rr {st.rr_tokens / max(1, st.best_tokens):5.1%})  "
        f"blocks {hb:6d}  in-process lag p50/p99 {lag[0]}/{lag[1]} ms"
    )


async def _create_topic(bootstrap, topic, partitions, client_options=None) -> None:
    from kvwire.kafka.topics import ensure_topic

    await ensure_topic(bootstrap, topic, partitions, client_options=client_options)


async def _end_offsets(bootstrap, topic, opts=None) -> dict[int, int]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    c = AIOKafkaConsumer(bootstrap_servers=bootstrap, **(opts or {}))
    try:
        await c.start()  # in the try: a client whose start failed must still be stopped
        parts = c.partitions_for_topic(topic)
        if not parts:
            await c._client.force_metadata_update()
            parts = c.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in parts]
        return {tp.partition: off for tp, off in (await c.end_offsets(tps)).items()}
    finally:
        await c.stop()
