"""`kvwire bridge`: forward one vLLM ZMQ KV-event stream (one DP rank) to Kafka.

Imports stay inside the command: every `kvwire ...` call imports this module."""

from __future__ import annotations

from typing import Any

import typer

app = typer.Typer(add_completion=False, help="Forward a vLLM ZMQ KV-event stream to Kafka.")


@app.callback(invoke_without_command=True)
def bridge(
    zmq_endpoint: str = typer.Option(
        ..., help="vLLM --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557 (+ dp_rank)."
    ),
    instance_id: str = typer.Option(..., help="Stable id of the vLLM instance (the routing target)."),
    bootstrap_servers: str = typer.Option(..., help="Kafka bootstrap servers."),
    topic: str = typer.Option(..., help="Kafka topic."),
    replay_endpoint: str = typer.Option(None, help="vLLM replay_endpoint (ROUTER), to fill sequence holes."),
    model: str = typer.Option("", help="Served model name recorded with every batch."),
    dp_rank: int = typer.Option(0, help="Data-parallel rank this stream belongs to."),
    zmq_topic: str = typer.Option("", help="vLLM KV-events topic (SUB prefix filter)."),
    partitions: int = typer.Option(12, help="Partitions if the topic must be created."),
    replay_timeout_s: float = typer.Option(
        5.0, help="A replay not answered within this long marks the engine down (untrusted)."
    ),
    liveness_interval_s: float = typer.Option(
        2.0, help="Engine silent this long: probe its replay socket (no answer = engine down, untrusted)."
    ),
    log_level: str = typer.Option("INFO"),
    kafka_config: str | None = typer.Option(
        None,
        "--kafka-config",
        envvar="KVWIRE_KAFKA_CONFIG",
        help="Kafka client properties file (security.protocol, sasl.*, ssl.*)",
    ),
    framing: str = typer.Option(
        "single-object",
        envvar="KVWIRE_FRAMING",
        help="single-object (no registry) or confluent (00 + registry id: Connect, ksqlDB, Confluent serdes).",
    ),
    schema_registry_url: str | None = typer.Option(
        None,
        envvar="KVWIRE_SCHEMA_REGISTRY_URL",
        help="Schema registry (Confluent API) for --framing confluent; credentials from the environment.",
    ),
) -> None:
    from kvwire.producer.zmq_bridge import ZmqBridge

    run_bridge(
        ZmqBridge,
        "vllm-zmq",
        "vLLM",
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
        framing=framing,
        schema_registry_url=schema_registry_url,
    )


def run_bridge(
    bridge_cls: Any,
    source: str,
    engine: str,
    *,
    zmq_endpoint: str,
    instance_id: str,
    bootstrap_servers: str,
    topic: str,
    replay_endpoint: str | None,
    model: str,
    dp_rank: int,
    zmq_topic: str,
    partitions: int,
    replay_timeout_s: float,
    liveness_interval_s: float,
    log_level: str,
    kafka_config: str | None,
    framing: str = "single-object",
    schema_registry_url: str | None = None,
) -> None:
    """One engine's ZMQ stream (one DP rank) into Kafka until SIGINT/SIGTERM: the body of
    `kvwire bridge` and `kvwire sglang-bridge`, which differ only in the payload decoder."""
    import asyncio
    import logging
    import signal

    from kvwire.options import client_options
    from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
    from kvwire.producer.zmq_bridge import BridgeConfig
    from kvwire.schemas.events import WorkerId

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvwire.bridge")

    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=bootstrap_servers,
            topic=topic,
            partitions=partitions,
            client_options=client_options(kafka_config),
            framing=framing,
            schema_registry_url=schema_registry_url,
        )
    )
    # The ZMQ stream is emitted after TP aggregation (vLLM), or by attention TP rank 0 only
    # (SGLang): one rank per worker. Its state is unknown until the bridge has replayed.
    stream = pub.stream(WorkerId(instance_id, dp_rank, 0, 1, model), source=source, state_known=False)
    br = bridge_cls(
        BridgeConfig(
            zmq_endpoint,
            replay_endpoint,
            zmq_topic,
            replay_timeout_s,
            expected_dp_rank=dp_rank,
            liveness_interval_s=liveness_interval_s,
        ),
        stream,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "bridging %s %s -> %s/%s as %s/%d", engine, zmq_endpoint, bootstrap_servers, topic, instance_id, dp_rank
        )
        await br.run(stop)

    try:
        asyncio.run(main())
    finally:
        # Flushes what the stream still holds before the process exits.
        pub.close()
        log.info("bridge stopped: %s", br.stats)
