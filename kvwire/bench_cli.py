"""`kvwire bench`: every benchmark against a real broker, plots and bench/results/summary.json."""

from __future__ import annotations

import typer

app = typer.Typer(invoke_without_command=True, add_completion=False, help="Run the benchmarks (bench/README.md).")


@app.callback()
def bench(
    quick: bool = typer.Option(False, "--quick", help="Small sizes: a few minutes on 2 cores."),
    smoke: bool = typer.Option(False, "--smoke", help="Tiny sizes: checks the harness, not speed."),
    only: list[str] = typer.Option(None, "--only", help="Run only this step (repeatable)."),
    results: str = typer.Option(None, "--results", help="Results folder (default bench/results)."),
    bootstrap: str = typer.Option(None, "--bootstrap", help="Kafka bootstrap servers."),
) -> None:
    from bench.run import main

    argv = ["--quick"] if quick else ["--smoke"] if smoke else []
    if only:
        argv += ["--only", *only]
    if results:
        argv += ["--results", results]
    if bootstrap:
        argv += ["--bootstrap", bootstrap]
    raise typer.Exit(main(argv))
