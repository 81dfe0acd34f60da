"""`kvwire replay`: rebuild an index from the log and print (or write) its summary and digest."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import typer

from kvwire.cli_failure import kafka_client_options, one_line, reaching_kafka
from kvwire.cli_options import DEFAULT_TOPIC, Bootstrap, KafkaConfig, Topic


@dataclass(frozen=True)
class ReplayOptions:
    """`kvwire replay` as parsed."""

    bootstrap_servers: str
    topic: str
    start: str | datetime  # "earliest", "snapshot" or a time
    until: datetime | None  # None: the end offsets at the start
    snapshot_dir: str | None
    json_path: str | None
    kafka_config: str | None


def _when(s: str) -> datetime:
    try:
        t = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise typer.BadParameter(f"not an ISO-8601 time: {s!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def replay(
    bootstrap_servers: Bootstrap,
    topic: Topic = DEFAULT_TOPIC,
    start: str = typer.Option("earliest", "--from", help="earliest | snapshot | <ISO-8601 time>"),
    until: str = typer.Option("end", "--until", help="end | <ISO-8601 time>"),
    snapshot_dir: str | None = typer.Option(
        None,
        "--snapshot-dir",
        help="With --from snapshot: read snapshots from this directory instead of <topic>.snapshots",
    ),
    json_path: str | None = typer.Option(None, "--json", help="Write the summary as JSON here ('-' for stdout)"),
    kafka_config: KafkaConfig = None,
) -> None:
    """Rebuild an index from the topic; report records, blocks/s, per-worker blocks and the digest."""
    opts = ReplayOptions(
        bootstrap_servers,
        topic,
        start if start in ("earliest", "snapshot") else _when(start),
        None if until == "end" else _when(until),
        snapshot_dir,
        json_path,
        kafka_config,
    )
    with one_line("replay"):
        _replay(opts)


def _replay(o: ReplayOptions) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from kvwire.consumer.replay import replay as run_replay
    from kvwire.consumer.snapshot import snapshot_store

    opts = kafka_client_options(o.kafka_config)
    snaps = (
        snapshot_store(o.bootstrap_servers, o.topic, directory=o.snapshot_dir, client_options=opts)
        if o.start == "snapshot"
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
                with reaching_kafka(o.bootstrap_servers):
                    return await run_replay(
                        o.bootstrap_servers,
                        o.topic,
                        o.start,
                        o.until,
                        snapshots=snaps,
                        client_options=opts,
                        progress=progress,
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
    if o.json_path:
        out = {k: s[k] for k in ("records", "events", "workers", "digest")}
        text = json.dumps(out, indent=2)
        if o.json_path == "-":
            typer.echo(text)
        else:
            with open(o.json_path, "w") as f:
                f.write(text + "\n")
