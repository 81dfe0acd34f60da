"""`kvwire index`: one index member (consumer-group member + HTTP API) until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal

import typer

from kvwire.options import client_options_from_env


def index(
    bootstrap_servers: str = typer.Option(..., "--bootstrap-servers", "-b", envvar="KAFKA_BOOTSTRAP_SERVERS"),
    topic: str = typer.Option("kvwire.events", "--topic", "-t"),
    group: str | None = typer.Option(
        None,
        "--group",
        "-g",
        help="Consumer group. Omit: a group of its own (full index). Shared: each member indexes its partitions.",
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
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Build a prefix-cache index from the topic and serve it over HTTP."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = http.rpartition(":")
    asyncio.run(
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
        )
    )


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
) -> None:
    from kvwire.consumer.http import make_app, serve
    from kvwire.consumer.ingest import IndexMember, IngestConfig

    opts = client_options_from_env()
    cfg = IngestConfig(bootstrap, topic, group_id=group, heartbeat_timeout_s=heartbeat_timeout, client_options=opts)
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
    runner = await serve(make_app(member.applier, lambda: member.ready, peers=peers, max_tokens=max_tokens), host, port)
    typer.echo(f"kvwire index: group {member.group_id}, http://{host}:{port}", err=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await member.stop()
