"""`kvwire kafka start|status|stop` — stdout carries only the bootstrap, so scripts can `tail -1` it."""

from __future__ import annotations

import logging
import sys
import time

import typer

from kvwire.cli_options import Bootstrap, KafkaConfig

app = typer.Typer(no_args_is_help=True, help="Run the local Kafka (KRaft): one broker, or a cluster with --brokers N.")

HomeOpt = typer.Option(None, "--home", envvar="KVWIRE_KAFKA_HOME", help="state dir")
PortOpt = typer.Option(None, "--port", envvar="KVWIRE_KAFKA_PORT", help="broker port (controller = +1)")
BrokersOpt = typer.Option(
    1,
    "--brokers",
    min=1,
    help="Brokers: >1 runs a KRaft cluster on one machine (node i on port+2i; default port 19192, "
    "home <home>/cluster-N), replication 3 and min.insync.replicas 2 from three brokers on",
)


def _broker(home: str | None, port: int | None, brokers: int = 1):
    from kvwire.kafka.broker.local import LocalKafka

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if brokers > 1:
        from pathlib import Path

        from kvwire.kafka.broker.cluster import LocalCluster

        return LocalCluster(Path(home) / f"cluster-{brokers}" if home else None, port, brokers)
    return LocalKafka(home, port)


FreshOpt = typer.Option(
    False,
    "--fresh",
    help="Start from an empty log (every topic and offset gone) when this launches the broker; "
    "a broker already running is used as it is",
)


@app.command()
def start(
    home: str | None = HomeOpt, port: int | None = PortOpt, brokers: int = BrokersOpt, fresh: bool = FreshOpt
) -> None:
    """Start (or find running) and print the bootstrap servers as the last stdout line."""
    from kvwire.kafka.broker.local import BrokerError

    t0 = time.monotonic()
    kafka = _broker(home, port, brokers)
    try:
        bootstrap = kafka.start(fresh=fresh)
    except BrokerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"Kafka ready in {time.monotonic() - t0:.1f}s (home {kafka.home})", err=True)
    typer.echo(bootstrap)


@app.command()
def status(home: str | None = HomeOpt, port: int | None = PortOpt, brokers: int = BrokersOpt) -> None:
    """Exit 0 when the broker (every broker of a cluster) runs and answers, 1 otherwise."""
    kafka = _broker(home, port, brokers)
    if brokers > 1:
        cst = kafka.status()
        typer.echo(f"{sum(cst.running)}/{len(cst.running)} running {cst.bootstrap}")
        raise typer.Exit(0 if cst.all_running else 1)
    st = kafka.status()
    typer.echo(f"{'running' if st.running else 'not running'} {st.bootstrap} pid={st.pid}")
    raise typer.Exit(0 if st.running else 1)


@app.command()
def stop(home: str | None = HomeOpt, port: int | None = PortOpt, brokers: int = BrokersOpt) -> None:
    """Graceful stop; SIGKILL after 30 s. Data is kept."""
    _broker(home, port, brokers).stop()
    typer.echo("stopped", err=True)


@app.command()
def image(
    base: str | None = typer.Option(
        None, "--base", help="Debian bookworm image to build FROM (pulled); default: a local debootstrap base"
    ),
    engine: str | None = typer.Option(None, "--engine", help="podman or docker; default: the first that answers"),
    app_checkout: str | None = typer.Option(
        None, "--app", help="also build the project's own image (index/demo) from this checkout's Dockerfile"
    ),
) -> None:
    """Build the broker image (localhost/kvwire-kafka:<version>) and print its reference last."""
    from pathlib import Path

    from kvwire.kafka.broker import image as images

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    t0 = time.monotonic()
    try:
        exe = images.find_engine(engine)
        ref = images.build_kafka(exe, base)
        if app_checkout:
            app_ref = images.build_app(Path(app_checkout), exe, base)
            typer.echo(f"app image: {app_ref}", err=True)
    except images.ImageError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"image ready in {time.monotonic() - t0:.1f}s ({Path(exe).name})", err=True)
    typer.echo(ref)


@app.command()
def wait(
    bootstrap_servers: Bootstrap,
    timeout: float = typer.Option(120.0, "--timeout", help="seconds before giving up (exit 1)"),
    topic: list[str] = typer.Option([], "--topic", "-t", help="also make sure this topic exists (repeatable)"),
    partitions: int = typer.Option(12, "--partitions", help="partitions of a topic created here"),
    kafka_config: KafkaConfig = None,
) -> None:
    """Block until the broker answers a metadata round trip: the readiness wait a compose service
    runs before its command, since healthcheck-gated depends_on needs systemd under podman.
    --topic creates a missing topic (kvwire's replication rules), so a consumer subscribing to it
    next is assigned its partitions at once instead of at its next metadata refresh."""
    from kvwire.cli_failure import kafka_client_options, one_line
    from kvwire.kafka.broker import probe
    from kvwire.kafka.options import admin_options

    with one_line("kafka wait"):
        opts = kafka_client_options(kafka_config)
    t0 = time.monotonic()
    while not probe.answers(bootstrap_servers, 5.0, **admin_options(opts)):
        if time.monotonic() - t0 > timeout:
            typer.echo(f"Kafka at {bootstrap_servers} not ready after {timeout:.0f}s", err=True)
            raise typer.Exit(1)
        time.sleep(0.5)
    typer.echo(f"Kafka at {bootstrap_servers} ready after {time.monotonic() - t0:.1f}s", err=True)
    if topic:
        from kvwire.kafka.topics import ensure_topics

        have = probe.run_sync(lambda: ensure_topics(bootstrap_servers, list(topic), partitions, client_options=opts))
        typer.echo(f"topics: {have}", err=True)
