"""`kvwire bench`: every benchmark against a real broker, plots and bench/results/summary.json."""

from __future__ import annotations

from collections.abc import Callable

import typer

from kvwire.cli_options import OptionalBootstrap

app = typer.Typer(invoke_without_command=True, add_completion=False, help="Run the benchmarks (bench/README.md).")


@app.callback()
def bench(
    quick: bool = typer.Option(False, "--quick", help="Small sizes: a few minutes on 2 cores."),
    smoke: bool = typer.Option(False, "--smoke", help="Tiny sizes: checks the harness, not speed."),
    only: list[str] = typer.Option(None, "--only", help="Run only this step (repeatable)."),
    results: str = typer.Option(None, "--results", help="Results folder (default bench/results)."),
    peers_holder_blocks: int = typer.Option(
        None, "--peers-holder-blocks", help="Size of the peers step (default 10M, --quick 1M)."
    ),
    bootstrap_servers: OptionalBootstrap = None,
) -> None:
    main = _bench_main()

    argv = ["--quick"] if quick else ["--smoke"] if smoke else []
    if only:
        argv += ["--only", *only]
    if results:
        argv += ["--results", results]
    if peers_holder_blocks:
        argv += ["--peers-holder-blocks", str(peers_holder_blocks)]
    if bootstrap_servers:
        argv += ["--bootstrap", bootstrap_servers]
    raise typer.Exit(main(argv))


def _bench_main() -> Callable[[list[str]], int]:
    """bench/ lives in the checkout, not in the wheel: find it beside the kvwire package's source.
    Imported by name because no installed copy of kvwire (or its type checker) can see it."""
    import importlib
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "run.py").is_file():
        raise typer.BadParameter("kvwire bench runs from a source checkout (bench/ is not installed)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    main: Callable[[list[str]], int] = importlib.import_module("bench.run").main
    return main
