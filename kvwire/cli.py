"""The `kvwire` command: a thin root. Each subsystem owns its commands in its own module and adds
exactly one line below, so parallel work never conflicts here. Keep sub-modules cheap to import
(heavy imports inside command bodies): every `kvwire ...` call imports all of them."""

import typer

from kvwire.bench_cli import app as _bench
from kvwire.bridge_cli import app as _bridge
from kvwire.demo import demo as _demo
from kvwire.index_cli import index as _index
from kvwire.kafka_cli import app as _kafka
from kvwire.registry_cli import app as _registry
from kvwire.replay_cli import replay as _replay
from kvwire.schemas_cli import app as _schemas
from kvwire.sglang_cli import app as _sglang_bridge
from kvwire.tail import app as _tail

app = typer.Typer(no_args_is_help=True, add_completion=False, help="KV-cache events on Kafka.")

app.add_typer(_kafka, name="kafka")
app.command(name="demo")(_demo)
app.command(name="index")(_index)
app.add_typer(_bridge, name="bridge")
app.add_typer(_sglang_bridge, name="sglang-bridge")
app.command(name="replay")(_replay)
app.add_typer(_tail, name="tail")
app.add_typer(_schemas, name="schemas")
app.add_typer(_bench, name="bench")
app.add_typer(_registry, name="registry")

if __name__ == "__main__":
    app()
