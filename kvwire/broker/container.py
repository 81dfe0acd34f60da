"""apache/kafka in a testcontainer, for developers who do have a Docker engine."""

from __future__ import annotations

import os
import socket
from typing import Any

from . import probe

IMAGE = os.environ.get("KVWIRE_KAFKA_IMAGE", "apache/kafka:4.1.0")


def docker_available(timeout_s: float = 3.0) -> bool:
    """A Docker *client* is not enough (our CI boxes have one without an engine): ping the engine."""
    try:
        import docker

        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def kafka_env(host: str, host_port: int) -> dict[str, str]:
    """Every KAFKA_* the image needs: setting any of them discards all of the image's defaults."""
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_LISTENERS": "PLAINTEXT://:9092,CONTROLLER://:9093,PLAINTEXT_HOST://:19092",
        # Clients on the host reach the mapped port, so that is what metadata must advertise.
        "KAFKA_ADVERTISED_LISTENERS": f"PLAINTEXT://localhost:9092,PLAINTEXT_HOST://{host}:{host_port}",
        "KAFKA_LISTENER_SECURITY_PROTOCOL_MAP": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT,PLAINTEXT_HOST:PLAINTEXT",
        "KAFKA_CONTROLLER_LISTENER_NAMES": "CONTROLLER",
        "KAFKA_INTER_BROKER_LISTENER_NAME": "PLAINTEXT",
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_OFFSETS_TOPIC_NUM_PARTITIONS": "1",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR": "1",
        "KAFKA_TRANSACTION_STATE_LOG_NUM_PARTITIONS": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR": "1",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "true",
        "KAFKA_NUM_PARTITIONS": "1",
        "KAFKA_LOG_DIRS": "/tmp/kraft-combined-logs",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DockerKafka:
    """`with DockerKafka() as bootstrap: ...` — container removed on exit (and by Ryuk on crash)."""

    def __init__(self, image: str = IMAGE, start_timeout_s: float = 90.0) -> None:
        self.image = image
        self.start_timeout_s = start_timeout_s
        self.container: Any = None
        self.bootstrap: str | None = None

    def start(self) -> str:
        import time

        from testcontainers.core.container import DockerContainer
        from testcontainers.core.docker_client import DockerClient

        # The advertised port must be known before start, so bind a pre-picked free host port.
        host, host_port = DockerClient().host(), _free_port()
        c = DockerContainer(self.image).with_bind_ports(19092, host_port)
        for k, v in kafka_env(host, host_port).items():
            c = c.with_env(k, v)
        self.container = c.start()
        self.bootstrap = f"{host}:{host_port}"
        deadline = time.monotonic() + self.start_timeout_s
        while not probe.answers(self.bootstrap, 5.0):
            if time.monotonic() > deadline:
                logs = self.container.get_logs()
                self.stop()
                raise RuntimeError(f"Kafka container not ready in {self.start_timeout_s:.0f}s: {logs}")
            time.sleep(0.5)
        return self.bootstrap

    def stop(self) -> None:
        if self.container is not None:
            self.container.stop()
            self.container = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
