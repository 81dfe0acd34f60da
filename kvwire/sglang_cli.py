"""`kvwire sglang-bridge`: forward one SGLang ZMQ KV-event stream (one DP rank) to Kafka.

The bridge of `kvwire bridge` with SGLang's payload decoder (producer/sglang_source.py).
Imports stay inside the command: every `kvwire ...` call imports this module."""

from __future__ import annotations

import typer

from kvwire.cli_options import DEFAULT_TOPIC, Bootstrap, KafkaConfig, Topic

app = typer.Typer(add_completion=False, help="Forward an SGLang ZMQ KV-event stream to Kafka.")


@app.callback(invoke_without_command=True)
def sglang_bridge(
    bootstrap_servers: Bootstrap,
    zmq_endpoint: str = typer.Option(
        ..., help="SGLang --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557 (+ DP rank)."
    ),
    instance_id: str = typer.Option(..., help="Stable id of the SGLang server (the routing target)."),
    topic: Topic = DEFAULT_TOPIC,
    replay_endpoint: str = typer.Option(None, help="SGLang replay_endpoint (ROUTER): needed to trust the worker."),
    model: str = typer.Option("", help="Served model name recorded with every batch."),
    dp_rank: int = typer.Option(0, help="DP (attention-DP) rank this stream belongs to."),
    zmq_topic: str = typer.Option("", help="SGLang KV-events topic (SUB prefix filter)."),
    partitions: int = typer.Option(12, help="Partitions if the topic must be created."),
    replay_timeout_s: float = typer.Option(5.0, help="A replay not answered within this long: engine down."),
    liveness_interval_s: float = typer.Option(2.0, help="Engine silent this long: probe its replay socket."),
    log_level: str = typer.Option("INFO"),
    kafka_config: KafkaConfig = None,
) -> None:
    from kvwire.bridge_cli import BridgeOptions, run_bridge
    from kvwire.producer.sglang_source import SOURCE, SglangBridge

    opts = BridgeOptions(
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
    run_bridge(SglangBridge, SOURCE, "SGLang", opts, command="sglang-bridge")
