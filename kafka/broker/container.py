"""Our Kafka image (localhost/kvwire-kafka:<version>, see image.py) in a testcontainer.

testcontainers' generic DockerContainer, not its KafkaContainer: that one assumes the Confluent
image layout and parses the tag as a Confluent version, and our image is neither. Any engine with
a Docker API works: Docker itself, or podman's `podman system service` socket in DOCKER_HOST
(with TESTCONTAINERS_RYUK_DISABLED=true and TESTCONTAINERS_CONNECTION_MODE=docker_host, which
.ci/containers-engine.sh sets)."""

from __future__ import annotations

import importlib
import os
import socket
import time
from typing import Any

from . import probe

IMAGE_ENV = "KVWIRE_KAFKA_IMAGE"
# Inside the container: 9092 for containers on its network, 19092 published to the host.
HOST_LISTENER_PORT = 19092


def default_image() -> str:
    from .image import kafka_ref

    return os.environ.get(IMAGE_ENV) or kafka_ref()


def docker_available(timeout_s: float = 3.0) -> bool:
    """A Docker *client* is not enough (our CI boxes have one without an engine): ping the engine."""
    try:
        docker: Any = importlib.import_module("docker")  # untyped; testcontainers brings it
        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def kafka_env(host: str, host_port: int) -> dict[str, str]:
    """Every KAFKA_* setting (apache/kafka's convention, which our image follows too): setting any
    of them replaces all of the image's defaults."""
    return {
        "KAFKA_NODE_ID": "1",
        "KAFKA_PROCESS_ROLES": "broker,controller",
        "KAFKA_CONTROLLER_QUORUM_VOTERS": "1@localhost:9093",
        "KAFKA_LISTENERS": f"PLAINTEXT://:9092,CONTROLLER://:9093,PLAINTEXT_HOST://:{HOST_LISTENER_PORT}",
        # Clients on the host reach the published port, so that is what metadata must advertise.
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
        "KAFKA_MIN_INSYNC_REPLICAS": "1",
        "KAFKA_GROUP_INITIAL_REBALANCE_DELAY_MS": "0",
        "KAFKA_AUTO_CREATE_TOPICS_ENABLE": "true",
        "KAFKA_NUM_PARTITIONS": "1",
        # As LocalKafka: a killed broker re-registers after 4 s, not 9; few threads on 2 cores.
        "KAFKA_BROKER_HEARTBEAT_INTERVAL_MS": "500",
        "KAFKA_BROKER_SESSION_TIMEOUT_MS": "4000",
        "KAFKA_NUM_NETWORK_THREADS": "2",
        "KAFKA_NUM_IO_THREADS": "2",
        "KAFKA_LOG_CLEANER_DEDUPE_BUFFER_SIZE": "16777216",
        "KAFKA_LOG_DIRS": "/var/lib/kafka/data",
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_image(ref: str) -> str:
    """Our own image is built on demand (from the jars `kvwire kafka start` uses); any other
    reference is left to the engine to have or pull."""
    from . import image

    if ref == image.kafka_ref():
        engine = image.find_engine()
        if not image.image_exists(engine, ref):
            image.build_kafka(engine)
    return ref


class DockerKafka:
    """`with DockerKafka() as bootstrap: ...` — the container is removed on exit.

    `stop_broker()` / `kill_broker()` then `start_broker()` restart the same container: its log
    and cluster id stay, and the published port and advertised address do not change."""

    def __init__(self, image: str | None = None, start_timeout_s: float = 120.0, cluster_id: str | None = None) -> None:
        """cluster_id: format the log with this id (CLUSTER_ID) instead of a fresh random one."""
        self.image = image or default_image()
        self.start_timeout_s = start_timeout_s
        self.cluster_id = cluster_id
        self.container: Any = None
        self.bootstrap: str | None = None

    def start(self) -> str:
        from testcontainers.core.container import DockerContainer
        from testcontainers.core.docker_client import DockerClient

        ensure_image(self.image)
        host = DockerClient().host()
        # "localhost" may resolve to ::1 first, and the port is published on IPv4 loopback only.
        host = "127.0.0.1" if host in ("localhost", "") else host
        # The advertised port must be known before start, so bind a pre-picked free host port.
        host_port = _free_port()
        c = DockerContainer(self.image)
        # Published on loopback only (with_bind_ports takes no address; docker-py does).
        ports: dict[str, Any] = c.ports
        ports[f"{HOST_LISTENER_PORT}/tcp"] = (host, host_port)
        for k, v in kafka_env(host, host_port).items():
            c = c.with_env(k, v)
        if self.cluster_id is not None:
            c = c.with_env("CLUSTER_ID", self.cluster_id)
        self.container = c.start()
        self.bootstrap = f"{host}:{host_port}"
        self._wait_ready()
        return self.bootstrap

    def _wait_ready(self) -> None:
        assert self.bootstrap is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not probe.answers(self.bootstrap, 5.0):
            wrapped = self.container.get_wrapped_container()
            wrapped.reload()
            if wrapped.status in ("exited", "dead") or time.monotonic() > deadline:
                logs = self.logs()
                self.stop()
                raise RuntimeError(
                    f"Kafka container not ready ({wrapped.status}) in {self.start_timeout_s:.0f}s: {logs}"
                )
            time.sleep(0.5)

    def logs(self, tail: int = 60) -> str:
        try:
            out = self.container.get_wrapped_container().logs(tail=tail)
            return out.decode(errors="replace")
        except Exception as e:
            return f"(no logs: {e})"

    # -- restarts of the same container ----------------------------------------------------------
    def stop_broker(self, timeout_s: int = 30) -> None:
        """SIGTERM (controlled shutdown), SIGKILL after timeout_s; the container and its log stay."""
        self.container.get_wrapped_container().stop(timeout=timeout_s)

    def kill_broker(self) -> None:
        """SIGKILL, no controlled shutdown; the container and its log stay."""
        self.container.get_wrapped_container().kill()
        self.container.get_wrapped_container().wait(timeout=30)

    def start_broker(self) -> str:
        self.container.get_wrapped_container().start()
        self._wait_ready()
        assert self.bootstrap is not None
        return self.bootstrap

    def running(self) -> bool:
        wrapped = self.container.get_wrapped_container()
        wrapped.reload()
        return wrapped.status == "running"

    def stop(self) -> None:
        """Remove the container (testcontainers' stop removes it, with its data)."""
        if self.container is not None:
            self.container.stop()
            self.container = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
