"""`kvwire index`: one index member (consumer-group member + HTTP API) until SIGINT/SIGTERM.

It exits 1 when the member becomes unhealthy (its ingest task died, or snapshots failed
``--snapshot-failures`` times in a row): a member that only answers stale scores is worse than
one an orchestrator restarts."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import typer

from kvwire.cli_failure import Unreachable, kafka_client_options, one_line, reaching_kafka
from kvwire.cli_options import DEFAULT_TOPIC, Bootstrap, KafkaConfig, Topic

if TYPE_CHECKING:
    from kvwire.consumer.http_security import HttpSecurity


@dataclass(frozen=True)
class IndexOptions:
    """`kvwire index` as parsed: built once by the command, read by everything it starts."""

    bootstrap_servers: str
    topic: str
    group: str | None
    host: str
    port: int
    peers: tuple[str, ...]
    heartbeat_timeout_s: float
    snapshot_dir: str | None
    snapshots: bool
    snapshot_interval_s: float
    snapshot_records: int
    snapshot_failures: int
    snapshot_retry_s: float
    max_tokens: int
    kafka_config: str | None
    http_workers: int
    lmcache_topic: str | None
    lmcache_model: str | None
    hold_ttl_s: float
    # (host, first port) of the vLLM-format event streams; None: not served.
    event_streams: tuple[str, int] | None = None
    # TLS, client certificates and the bearer token of the HTTP API; None: open, plain HTTP.
    security: HttpSecurity | None = None
    # Ingest on one CPU, the HTTP loops on the others (kvwire.consumer.cpus).
    cpu_split: bool = True


def index(
    bootstrap_servers: Bootstrap,
    topic: Topic = DEFAULT_TOPIC,
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
    kafka_config: KafkaConfig = None,
    http_workers: int = typer.Option(
        1,
        "--http-workers",
        min=1,
        help="Event loops serving HTTP on one SO_REUSEPORT port over the one index (scores run without the GIL)",
    ),
    cpu_split: bool = typer.Option(
        True,
        "--cpu-split/--no-cpu-split",
        help="Run ingest on one CPU and the HTTP loops on the others (Linux, two CPUs or more): a score "
        "woken by ingest then never waits behind it on its CPU",
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
    event_streams: str | None = typer.Option(
        None,
        "--event-streams",
        help="[HOST:]PORT: serve each worker's state as vLLM's ZMQ KV-event wire (a PUB and a replay ROUTER "
        "per worker, ports from PORT upward, listed at GET /v1/streams) for vllm-router, Dynamo and llm-d. "
        "HOST defaults to 127.0.0.1; ZMQ has no authentication or encryption here, so bind it where only "
        "routers reach. Implies --no-snapshots: the streams describe blocks from the records they read.",
    ),
    tls_cert: str | None = typer.Option(
        None, "--tls-cert", help="Serve HTTPS with this PEM certificate chain (the key too, or --tls-key)"
    ),
    tls_key: str | None = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert"),
    tls_client_ca: str | None = typer.Option(
        None, "--tls-client-ca", help="Require client certificates signed by this CA (PEM); peers get ours"
    ),
    http_token_file: str | None = typer.Option(
        None,
        "--http-token-file",
        envvar="KVWIRE_HTTP_TOKEN_FILE",
        help="Every request must carry 'Authorization: Bearer <the file's text>' (401 otherwise); peers send it",
    ),
    log_level: str = typer.Option("INFO", "--log-level"),
) -> None:
    """Build a prefix-cache index from the topic and serve it over HTTP."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host, _, port = http.rpartition(":")
    if not port.isdigit():
        raise typer.BadParameter(f"HOST:PORT, not {http!r}", param_hint="--http")
    streams_at = None
    if event_streams is not None:
        s_host, _, s_port = event_streams.rpartition(":")
        if not s_port.isdigit() or not 0 < int(s_port) < 65535:
            raise typer.BadParameter(f"[HOST:]PORT, not {event_streams!r}", param_hint="--event-streams")
        streams_at = (s_host or "127.0.0.1", int(s_port))
    from kvwire.consumer.http_security import HttpSecurity, SecurityConfigError

    try:
        security = HttpSecurity.from_files(tls_cert, tls_key, tls_client_ca, http_token_file)
    except SecurityConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--tls-*/--http-token-file") from None
    opts = IndexOptions(
        bootstrap_servers=bootstrap_servers,
        topic=topic,
        group=group,
        host=host or "127.0.0.1",
        port=int(port),
        peers=tuple(peer),
        heartbeat_timeout_s=heartbeat_timeout,
        snapshot_dir=snapshot_dir,
        snapshots=snapshots,
        snapshot_interval_s=snapshot_interval,
        snapshot_records=snapshot_records,
        snapshot_failures=snapshot_failures,
        snapshot_retry_s=snapshot_retry,
        max_tokens=max_tokens,
        kafka_config=kafka_config,
        http_workers=http_workers,
        lmcache_topic=lmcache_topic,
        lmcache_model=lmcache_model,
        hold_ttl_s=hold_ttl_s,
        event_streams=streams_at,
        security=security,
        cpu_split=cpu_split,
    )
    with one_line("index"):
        code = asyncio.run(_run(opts))
    if code:
        raise typer.Exit(code)


async def _run(o: IndexOptions) -> int:
    from kvwire.consumer.cpus import CpuSplit
    from kvwire.consumer.holds import Holds
    from kvwire.consumer.http import HttpWorkers, make_app
    from kvwire.consumer.ingest import IndexMember, IngestConfig, default_group_id
    from kvwire.heap import freeze_startup_heap

    cpus = CpuSplit.here() if o.cpu_split else None
    if cpus is not None:
        cpus.install(asyncio.get_running_loop())
    opts = kafka_client_options(o.kafka_config)
    cfg = IngestConfig(
        o.bootstrap_servers,
        o.topic,
        group_id=o.group or default_group_id(o.topic, o.port),
        heartbeat_timeout_s=o.heartbeat_timeout_s,
        client_options=opts,
        snapshot_retry_s=o.snapshot_retry_s,
        snapshot_failure_limit=o.snapshot_failures,
    )
    store = None
    # A snapshot restores blocks without the records that describe them (token ids are not index
    # state): a member serving streams reads its partitions from the log instead.
    if o.snapshots and o.event_streams is None:
        from kvwire.consumer.snapshot import snapshot_store

        store = snapshot_store(
            o.bootstrap_servers,
            o.topic,
            directory=o.snapshot_dir,
            client_options=opts,
            interval_s=o.snapshot_interval_s,
            every_records=o.snapshot_records,
        )
    member = IndexMember(cfg, snapshots=store)
    streams = None
    if o.event_streams is not None:
        from kvwire.consumer.event_streams import EventStreams

        streams = EventStreams(member.applier, *o.event_streams)
        # Before ingest starts: a record applied unseen leaves its blocks undescribed.
        streams.attach()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    holds = Holds(o.hold_ttl_s)  # one for every HTTP loop: a route on one is seen by the others
    # HTTP on threads only: a flood of requests then competes with ingest for the GIL, not
    # for ingest's own loop (sharing it, ingest fell to a third of its rate under load).
    runner = HttpWorkers(
        lambda: make_app(
            member.applier,
            lambda: member.ready,
            peers=list(o.peers),
            max_tokens=o.max_tokens,
            health=lambda: member.failure,
            home=loop,
            holds=holds,
            streams=streams,
            security=o.security,
            topic=o.topic,
            block_table=streams.table if streams is not None else None,
            rank_endpoint=streams.endpoint if streams is not None else None,
            rank_block_size=(lambda inst, dp: streams.table.block_size((inst, dp))) if streams is not None else None,
        ),
        o.host,
        o.port,
        o.http_workers,
        on_caller_loop=False,
        tls=o.security.server_context() if o.security is not None else None,
        cpus=cpus,
    )
    # The port first: a member that could not serve must not join the group (and move
    # partitions around) at all. Until it is ready the API answers "not ready".
    try:
        port = await runner.start()
    except OSError as e:
        await runner.cleanup()
        raise Unreachable("HTTP", f"{o.host}:{o.port}", e.strerror or str(e), verb="listen for") from None
    feed = None
    try:
        if streams is not None:
            await streams.start()
        # This thread runs ingest's loop.
        placed = cpus is not None and cpus.pin_ingest()
        with reaching_kafka(o.bootstrap_servers):
            await member.start()
    except BaseException:
        await runner.cleanup()
        if streams is not None:
            await streams.stop()
        raise
    stopped = asyncio.ensure_future(stop.wait())
    failed = asyncio.ensure_future(member.wait_failed())
    try:
        if o.lmcache_topic:
            from kvwire.consumer.lmcache_feed import feed_member

            with reaching_kafka(o.bootstrap_servers):
                feed = await feed_member(member, o.lmcache_topic, o.lmcache_model)
        freeze_startup_heap()
        typer.echo(
            f"kvwire index: group {member.group_id}, {o.security.scheme if o.security else 'http'}://{o.host}:{port}"
            + (f" ({o.http_workers} HTTP workers)" if o.http_workers > 1 else "")
            + (f", ingest on CPU {','.join(map(str, sorted(cpus.ingest)))}" if cpus is not None and placed else "")
            + (f", event streams from tcp://{o.event_streams[0]}:{o.event_streams[1]}" if o.event_streams else ""),
            err=True,
        )
        await asyncio.wait([stopped, failed], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for f in (stopped, failed):
            f.cancel()
        await runner.cleanup()
        if feed is not None:
            await feed.stop()
        await member.stop()
        if streams is not None:
            await streams.stop()
    if failed.done() and not failed.cancelled():
        typer.echo(f"kvwire index: unhealthy, exiting: {failed.result()}", err=True)
        return 1
    return 0
