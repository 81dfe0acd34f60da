"""`kvwire bridge`: forward one vLLM ZMQ KV-event stream (one DP rank) to Kafka.

Imports stay inside the command: every `kvwire ...` call imports this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import typer

from kvwire.cli_failure import BadSetting, Unreachable, kafka_client_options, one_line, reaching_kafka
from kvwire.cli_options import DEFAULT_TOPIC, Bootstrap, KafkaConfig, Topic

app = typer.Typer(add_completion=False, help="Forward a vLLM ZMQ KV-event stream to Kafka.")


@dataclass(frozen=True)
class BridgeOptions:
    """`kvwire bridge` / `kvwire sglang-bridge` as parsed: one engine stream (one DP rank)."""

    zmq_endpoint: str
    instance_id: str
    bootstrap_servers: str
    topic: str = DEFAULT_TOPIC
    replay_endpoint: str | None = None
    model: str = ""
    dp_rank: int = 0
    zmq_topic: str = ""
    partitions: int = 12
    replay_timeout_s: float = 5.0
    liveness_interval_s: float = 2.0
    log_level: str = "INFO"
    kafka_config: str | None = None
    framing: str = "single-object"
    schema_registry_url: str | None = None


@app.callback(invoke_without_command=True)
def bridge(
    bootstrap_servers: Bootstrap,
    zmq_endpoint: str = typer.Option(
        ..., help="vLLM --kv-events-config endpoint, e.g. tcp://10.0.0.5:5557 (+ dp_rank)."
    ),
    instance_id: str = typer.Option(..., help="Stable id of the vLLM instance (the routing target)."),
    topic: Topic = DEFAULT_TOPIC,
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
    kafka_config: KafkaConfig = None,
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
        framing=framing,
        schema_registry_url=schema_registry_url,
    )
    run_bridge(ZmqBridge, "vllm-zmq", "vLLM", opts, command="bridge")


def run_bridge(bridge_cls: Any, source: str, engine: str, o: BridgeOptions, *, command: str) -> None:
    """One engine's ZMQ stream (one DP rank) into Kafka until SIGINT/SIGTERM: the body of
    `kvwire bridge` and `kvwire sglang-bridge`, which differ only in the payload decoder."""
    import logging

    logging.basicConfig(level=o.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with one_line(command):
        copts = kafka_client_options(o.kafka_config)
        _reachable(o, copts)
        _bridge(bridge_cls, source, engine, o, copts)


def _reachable(o: BridgeOptions, copts: Any) -> None:
    """What the bridge needs, had once before it starts: the publisher retries an outage forever
    (an engine's stream must survive one), so a wrong address would otherwise only ever be a
    warning in the log."""
    import asyncio

    from kvwire.kafka.topics import ensure_topic
    from kvwire.schemas.codec import CONFLUENT

    if o.framing == CONFLUENT:
        from kvwire.kafka.registry.client import RegistryClient, RegistryConfig

        try:
            reg = RegistryConfig.from_env(o.schema_registry_url)
        except ValueError as e:
            raise BadSetting(str(e)) from None
        if reg is None:
            raise BadSetting("--framing confluent needs --schema-registry-url or KVWIRE_SCHEMA_REGISTRY_URL")
        RegistryClient(reg).subjects()
    with reaching_kafka(o.bootstrap_servers):
        asyncio.run(ensure_topic(o.bootstrap_servers, o.topic, o.partitions, client_options=copts))


def _bridge(bridge_cls: Any, source: str, engine: str, o: BridgeOptions, copts: Any) -> None:
    import asyncio
    import logging
    import signal

    from kvwire.heap import freeze_startup_heap
    from kvwire.producer.publisher import KafkaPublisher, PublisherConfig
    from kvwire.producer.zmq_bridge import BridgeConfig
    from kvwire.schemas.events import WorkerId

    log = logging.getLogger("kvwire.bridge")
    pub = KafkaPublisher(
        PublisherConfig(
            bootstrap_servers=o.bootstrap_servers,
            topic=o.topic,
            partitions=o.partitions,
            client_options=copts,
            framing=o.framing,
            schema_registry_url=o.schema_registry_url,
        )
    )
    # The ZMQ stream is emitted after TP aggregation (vLLM), or by attention TP rank 0 only
    # (SGLang): one rank per worker. Its state is unknown until the bridge has replayed.
    stream = pub.stream(WorkerId(o.instance_id, o.dp_rank, 0, 1, o.model), source=source, state_known=False)
    br = bridge_cls(
        BridgeConfig(
            o.zmq_endpoint,
            o.replay_endpoint,
            o.zmq_topic,
            o.replay_timeout_s,
            expected_dp_rank=o.dp_rank,
            liveness_interval_s=o.liveness_interval_s,
        ),
        stream,
    )

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "bridging %s %s -> %s/%s as %s/%d",
            engine,
            o.zmq_endpoint,
            o.bootstrap_servers,
            o.topic,
            o.instance_id,
            o.dp_rank,
        )
        freeze_startup_heap()
        await br.run(stop)

    import zmq

    try:
        asyncio.run(main())
    except zmq.ZMQError as e:
        # pyzmq appends the address it was given: " (addr='...')".
        why, _, addr = (e.strerror or str(e)).partition(" (addr=")
        raise Unreachable(f"{engine}'s ZMQ endpoint", addr.rstrip(")").strip("'") or o.zmq_endpoint, why) from None
    finally:
        # Flushes what the stream still holds before the process exits.
        pub.close()
        log.info("bridge stopped: %s", br.stats)
