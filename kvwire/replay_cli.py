"""`kvwire replay`: rebuild an index from the log and print (or write) its summary and digest."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from datetime import UTC, datetime

import typer

from kvwire.options import client_options


def _when(s: str) -> datetime:
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"not an ISO-8601 time: {s!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def replay(
    bootstrap_servers: str = typer.Option(..., "--bootstrap-servers", "-b", envvar="KAFKA_BOOTSTRAP_SERVERS"),
    topic: str = typer.Option("kvwire.events", "--topic", "-t"),
    start: str = typer.Option("earliest", "--from", help="earliest | snapshot | <ISO-8601 time>"),
    until: str = typer.Option("end", "--until", help="end | <ISO-8601 time>"),
    snapshot_dir: str | None = typer.Option(
        None,
        "--snapshot-dir",
        help="With --from snapshot: read snapshots from this directory instead of <topic>.snapshots",
    ),
    json_path: str | None = typer.Option(None, "--json", help="Write the summary as JSON here ('-' for stdout)"),
    kafka_config: str | None = typer.Option(
        None,
        "--kafka-config",
        envvar="KVWIRE_KAFKA_CONFIG",
        help="Kafka client properties file (security.protocol, sasl.*, ssl.*)",
    ),
) -> None:
    """Rebuild an index from the topic; report records, blocks/s, per-worker blocks and the digest."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvwire.consumer.replay import replay as run_replay
    from kvwire.consumer.snapshot import snapshot_store

    opts = client_options(kafka_config)
    begin: str | datetime = start if start in ("earliest", "snapshot") else _when(start)
    end = None if until == "end" else _when(until)
    snaps = (
        snapshot_store(bootstrap_servers, topic, directory=snapshot_dir, client_options=opts)
        if start == "snapshot"
        else None
    )

    with Progress(
        TextColumn("[bold]replay[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("records"),
        TextColumn("{task.fields[rate]}"),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        # stderr: `--json -` owns stdout
        console=Console(stderr=True),
        transient=False,
        disable=not sys.stderr.isatty(),
    ) as bar:
        task = bar.add_task("replay", total=None, rate="")
        t0 = time.perf_counter()

        def progress(done, total, blocks):
            dt = max(time.perf_counter() - t0, 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{blocks / dt:,.0f} blocks/s")

        async def run():
            try:
                return await run_replay(
                    bootstrap_servers, topic, begin, end, snapshots=snaps, client_options=opts, progress=progress
                )
            finally:
                if snaps is not None:
                    await snaps.close()

        result = asyncio.run(run())
    s = result.summary()
    typer.echo(
        f"replayed {s['records']} records, {s['events']} events in {s['seconds']} s "
        f"({s['blocks_per_s']} blocks/s); {len(s['workers'])} workers, {s['holder_blocks']} holder-blocks, "
        f"{s['dead_letters']} malformed; digest {s['digest']}",
        err=True,
    )
    if json_path:
        out = {k: s[k] for k in ("records", "events", "workers", "digest")}
        text = json.dumps(out, indent=2)
        if json_path == "-":
            typer.echo(text)
        else:
            with open(json_path, "w") as f:
                f.write(text + "\n")
