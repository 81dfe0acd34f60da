"""`kvwire registry start|status|stop`: a local Apicurio Registry, run as `kvwire kafka` runs the
broker. stdout carries only the URL (the Confluent-compatible API), so scripts can `tail -1` it."""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from kvwire.kafka.registry.local import LocalRegistry

app = typer.Typer(no_args_is_help=True, help="Run a local schema registry (Apicurio Registry, Confluent API).")

HomeOpt = typer.Option(None, "--home", envvar="KVWIRE_REGISTRY_HOME", help="state dir")
PortOpt = typer.Option(None, "--port", envvar="KVWIRE_REGISTRY_PORT", help="HTTP port (default 18081)")


def _registry(home: str | None, port: int | None) -> LocalRegistry:
    from kvwire.kafka.registry.local import LocalRegistry

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    return LocalRegistry(home, port)


@app.command()
def start(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Start (or find running) and print the registry URL as the last stdout line."""
    from kvwire.kafka.registry.local import RegistryStartError

    t0 = time.monotonic()
    reg = _registry(home, port)
    try:
        url = reg.start()
    except RegistryStartError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"schema registry ready in {time.monotonic() - t0:.1f}s (home {reg.home})", err=True)
    typer.echo(url)


@app.command()
def status(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Exit 0 when the registry runs and answers, 1 otherwise."""
    st = _registry(home, port).status()
    typer.echo(f"{'running' if st.running else 'not running'} {st.url} pid={st.pid}")
    raise typer.Exit(0 if st.running else 1)


@app.command()
def stop(home: str | None = HomeOpt, port: int | None = PortOpt) -> None:
    """Graceful stop; SIGKILL after 30 s. Registered schemas are kept."""
    _registry(home, port).stop()
    typer.echo("stopped", err=True)
