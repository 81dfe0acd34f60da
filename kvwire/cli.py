"""The `kvwire` command: a thin root. Each subsystem owns its commands in its own module and adds
exactly one line below, so parallel work never conflicts here. Keep sub-modules cheap to import
(heavy imports inside command bodies): every `kvwire ...` call imports all of them."""
import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help="KV-cache events on Kafka.")

from kvwire.broker.cli import app as _kafka  # noqa: E402

app.add_typer(_kafka, name="kafka")
from kvwire.demo import demo as _demo  # noqa: E402
app.command(name="demo")(_demo)
from kvwire.index_cli import index as _index  # noqa: E402
app.command(name="index")(_index)
from kvwire.bridge_cli import app as _bridge; app.add_typer(_bridge, name="bridge")  # noqa: E402, E702
from kvwire.replay_cli import replay as _replay  # noqa: E402
app.command(name="replay")(_replay)
from kvwire.tail import app as _tail  # noqa: E402
app.add_typer(_tail, name="tail")
from kvwire.schemas_cli import app as _schemas  # noqa: E402
app.add_typer(_schemas, name="schemas")
from kvwire.bench_cli import app as _bench; app.add_typer(_bench, name="bench")  # noqa: E402, E702

if __name__ == "__main__":
    app()
