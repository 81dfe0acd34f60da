"""`kvwire sglang-bridge`: forward one SGLang ZMQ KV-event stream (one DP rank) to Kafka.

The bridge of `kvwire bridge` with SGLang's payload decoder (producer/sglang_source.py).
Imports stay inside the command: every `kvwire ...` call imports this module."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, help="Forward an SGLang ZMQ KV-event stream to Kafka.")


@app.callback(invoke_without_command=True)
def sglang_bridge(
    zmq_endpoint: str = typer.Option(
        ..., help="SGLang --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557 (+ DP rank)."
    ),
    instance_id: str = typer.Option(..., help="Stable id of the SGLang server (the routing target)."),
    bootstrap_servers: str = typer.Option(..., envvar="KAFKA_BOOTSTRAP_SERVERS", help="Kafka bootstrap servers."),
    topic: str = typer.Option("kvwire.events", help="Kafka topic."),
    replay_endpoint: str = typer.Option(None, help="SGLang replay_endpoint (ROUTER): needed to trust the worker."),
    model: str = typer.Option("", help="Served model name recorded with every batch."),
    dp_rank: int = typer.Option(0, help="DP (attention-DP) rank this stream belongs to."),
    zmq_topic: str = typer.Option("", help="SGLang KV-events topic (SUB prefix filter)."),
    partitions: int = typer.Option(12, help="Partitions if the topic must be created."),
    replay_timeout_s: float = typer.Option(5.0, help="A replay not answered within this long: engine down."),
    liveness_interval_s: float = typer.Option(2.0, help="Engine silent this long: probe its replay socket."),
    log_level: str = typer.Option("INFO"),
    kafka_config: str | None = typer.Option(
        None, "--kafka-config", envvar="KVWIRE_KAFKA_CONFIG", help="Kafka client properties file"
    ),
) -> None:
    from kvwire.bridge_cli import run_bridge
    from kvwire.producer.sglang_source import SOURCE, SglangBridge

    run_bridge(
        SglangBridge,
        SOURCE,
        "SGLang",
        zmq_endpoint=zmq_endpoint,
        instance_id=instance_id,
        bootstrap_servers=bootstrap_servers,
        topic=topic,
        replay_endpoint=replay_endpoint,
        model=model,
        dp_rank=dp_rank,
        zmq_topic=zmq_topic,
        partitions=partitions,
        replay_timeout_s=replay_timeout_s,
        liveness_interval_s=liveness_interval_s,
        log_level=log_level,
        kafka_config=kafka_config,
    )
