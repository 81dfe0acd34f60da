"""The options every command that talks to Kafka shares, defined once (typer `Annotated` aliases).

A command declares ``bootstrap_servers: Bootstrap`` (required; `OptionalBootstrap` where the
command can find or start a broker itself), ``topic: Topic = DEFAULT_TOPIC`` and
``kafka_config: KafkaConfig = None``: the spelling, short form, variable and help of each live
here, so no two commands can drift apart again."""

from __future__ import annotations

from typing import Annotated

import typer

from kvwire.kafka.options import CONFIG_ENV

BOOTSTRAP_ENV = "KAFKA_BOOTSTRAP_SERVERS"
DEFAULT_TOPIC = "kvwire.events"

_BOOTSTRAP_HELP = f"Kafka bootstrap servers, host:port[,host:port...] (or ${BOOTSTRAP_ENV})"

Bootstrap = Annotated[
    str, typer.Option("--bootstrap-servers", "-b", envvar=BOOTSTRAP_ENV, help=_BOOTSTRAP_HELP, show_envvar=False)
]
OptionalBootstrap = Annotated[
    str | None,
    typer.Option("--bootstrap-servers", "-b", envvar=BOOTSTRAP_ENV, help=_BOOTSTRAP_HELP, show_envvar=False),
]
Topic = Annotated[str, typer.Option("--topic", "-t", help="Kafka topic of the kvwire events")]
KafkaConfig = Annotated[
    str | None,
    typer.Option(
        "--kafka-config",
        envvar=CONFIG_ENV,
        metavar="PATH",
        help=f"Kafka client properties file: security.protocol, sasl.*, ssl.* (or ${CONFIG_ENV})",
        show_envvar=False,
    ),
]
