"""`kvwire index`: one index member (consumer-group member + HTTP API) until SIGINT/SIGTERM.

It exits 1 when the member becomes unhealthy (its ingest task died, or snapshots failed
``--snapshot-failures`` times in a row): a member that only answers stale scores is worse than
one an orchestrator restarts."""

from __future__ import annotations

import asyncio
import logging
import signal

import typer

from kvwire.options import CONFIG_ENV, client_options


def index(
    bootstrap_servers: str = typer.Option(..., "--bootstrap-servers", "-b", envvar="KAFKA_BOOTSTRAP_SERVERS"),
    topic: str = typer.Option("kvwire.events", "--topic", "-t"),
    group: str | None = typer.Option(
        None,
        "--group",
        "-g",
        help="Consumer group. Omit: kvwire-index.<topic>.<hostname>.<http port>, stable across restarts and "
        "one per router (full index). Shared: each member indexes its partitions.",
    ),
    http: str = typer.Option("127.0.0.1:8080", "--http", help="HOST:PORT for the HTTP API"),
    peer: list[str] = typer.Option(
        [], "--peer", help="Base URL of another member of the same group (scatter-gather score); repeatable"
    ),
    heartbeat_timeout: float = typer.Option(
        60.0, "--heartbeat-timeout", help="Seconds of silence after which a worker is expired"
    ),
    snapshot_dir: str | None = typer.Option(
        None, "--snapshot-dir", help="Store snapshots in this directory instead of the <topic>.snapshots topic"
    ),
    snapshots: bool = typer.Option(
        True, "--snapshots/--no-snapshots", help="Cold start from snapshots and write them periodically"
    ),
    snapshot_interval: float = typer.Option(
        60.0,
        "--snapshot-interval",
        help="Seconds between snapshots of a partition (the topic's retention must cover it, see consumer/snapshot.py)",
    ),
    snapshot_records: int = typer.Option(
        200_000, "--snapshot-records", help="Also snapshot a partition after this many of its records"
    ),
    max_tokens: int = typer.Option(256 * 1024, "--max-tokens", help="Largest prompt /v1/score accepts (413 above)"),
    snapshot_failures: int = typer.Option(
        5, "--snapshot-failures", min=1, help="Failed snapshot attempts in a row before the member is unhealthy"
    ),
    snapshot_retry: float = typer.Option(
        1.0, "--snapshot-retry", help="Seconds before the first snapshot retry (doubling, at most 60 s)"
    ),
    kafka_config: str | None = typer.Option(
        None,
        "--kafka-config",
        envvar=CONFIG_ENV,
        help="Kafka client properties file (security.protocol, sasl.*, ssl.*)",
    ),
    http_workers: int = typer.Option(
        1,
        "--http-workers",
        min=1,
        help="Event loops serving HTTP on one SO_REUSEPORT port over the one index (scores run without the GIL)",
    ),
    lmcache_topic: str | None = typer.Option(
        None,
        "--lmcache-topic",
        help="Also index LMCache's MP coordinator topic (its KafkaCacheEventSink's JSON cache events)",
    ),
    lmcache_model: str | None = typer.Option(None, "--lmcache-model", help="Keep only this model from --lmcache-topic"),
    hold_ttl_s: float = typer.Option(
        2.0,
        "--hold-ttl-s",
        min=0.0,
        help="Seconds a /v1/route speculative hold counts unless the worker's BlockStored confirms it first; "
        "0 disables holds",
    ),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Build a prefix-cache index from the topic and serve it over HTTP."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = http.rpartition(":")
    code = asyncio.run(
        _run(
            bootstrap_servers,
            topic,
            group,
            host or "127.0.0.1",
            int(port),
            peer,
            heartbeat_timeout,
            snapshot_dir,
            snapshots,
            max_tokens,
            snapshot_interval,
            snapshot_records,
            snapshot_failures,
            snapshot_retry,
            kafka_config,
            http_workers,
            lmcache_topic=lmcache_topic,
            lmcache_model=lmcache_model,
            hold_ttl_s=hold_ttl_s,
        )
    )
    if code:
        raise typer.Exit(code)


async def _run(
    bootstrap,
    topic,
    group,
    host,
    port,
    peers,
    heartbeat_timeout,
    snapshot_dir,
    use_snapshots,
    max_tokens,
    snapshot_interval=60.0,
    snapshot_records=200_000,
    snapshot_failures=5,
    snapshot_retry=1.0,
    kafka_config=None,
    http_workers=1,
    lmcache_topic=None,
    lmcache_model=None,
    hold_ttl_s=2.0,
) -> int:
    from kvwire.consumer.holds import Holds
    from kvwire.consumer.http import HttpWorkers, make_app
    from kvwire.consumer.ingest import IndexMember, IngestConfig, default_group_id

    opts = client_options(kafka_config)
    cfg = IngestConfig(
        bootstrap,
        topic,
        group_id=group or default_group_id(topic, port),
        heartbeat_timeout_s=heartbeat_timeout,
        client_options=opts,
        snapshot_retry_s=snapshot_retry,
        snapshot_failure_limit=snapshot_failures,
    )
    store = None
    if use_snapshots:
        from kvwire.consumer.snapshot import snapshot_store

        store = snapshot_store(
            bootstrap,
            topic,
            directory=snapshot_dir,
            client_options=opts,
            interval_s=snapshot_interval,
            every_records=snapshot_records,
        )
    member = IndexMember(cfg, snapshots=store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await member.start()
    feed = None
    if lmcache_topic:
        from kvwire.consumer.lmcache_feed import feed_member

        feed = await feed_member(member, lmcache_topic, lmcache_model)
    holds = Holds(hold_ttl_s)  # one for every HTTP loop: a route on one is seen by the others
    # HTTP on threads only: a flood of requests then competes with ingest for the GIL, not
    # for ingest's own loop (sharing it, ingest fell to a third of its rate under load).
    runner = HttpWorkers(
        lambda: make_app(
            member.applier,
            lambda: member.ready,
            peers=peers,
            max_tokens=max_tokens,
            health=lambda: member.failure,
            home=loop,
            holds=holds,
        ),
        host,
        port,
        http_workers,
        on_caller_loop=False,
    )
    await runner.start()
    typer.echo(
        f"kvwire index: group {member.group_id}, http://{host}:{port}"
        + (f" ({http_workers} HTTP workers)" if http_workers > 1 else ""),
        err=True,
    )
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(member.wait_failed())
    try:
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (stopped, failed):
            f.cancel()
        await runner.cleanup()
        if feed is not None:
            await feed.stop()
        await member.stop()
    if failed.done() and not failed.cancelled():
        typer.echo(f"kvwire index: unhealthy, exiting: {failed.result()}", err=True)
        return 1
    return 0
