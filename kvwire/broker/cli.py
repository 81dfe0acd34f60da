"""`kvwire kafka start|status|stop` — stdout carries only the bootstrap, so scripts can `tail -1` it."""

from __future__ import annotations

import logging
import sys
import time

import typer

app = typer.Typer(no_args_is_help=True, help="Run the local single-node Kafka (KRaft) broker.")

HomeOpt = typer.Option(None, "--home", envvar="KVWIRE_KAFKA_HOME", help="state dir")
PortOpt = typer.Option(None, "--port", envvar="KVWIRE_KAFKA_PORT", help="broker port (controller = +1)")


def _broker(home: str | None, port: int | None):
    from .local import LocalKafka

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    return LocalKafka(home, port)


@app.command()
def start(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Start (or find running) and print the bootstrap servers as the last stdout line."""
    from .local import BrokerError

    t0 = time.monotonic()
    kafka = _broker(home, port)
    try:
        bootstrap = kafka.start()
    except BrokerError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"Kafka ready in {time.monotonic() - t0:.1f}s (home {kafka.home})", err=True)
    typer.echo(bootstrap)


@app.command()
def status(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Exit 0 when the broker runs and answers, 1 otherwise."""
    st = _broker(home, port).status()
    typer.echo(f"{'running' if st.running else 'not running'} {st.bootstrap} pid={st.pid}")
    raise typer.Exit(0 if st.running else 1)


@app.command()
def stop(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Graceful stop; SIGKILL after 30 s. Data is kept."""
    _broker(home, port).stop()
    typer.echo("stopped", err=True)
