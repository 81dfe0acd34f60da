"""The broker under the integration tests when KVWIRE_TEST_BROKER=testcontainers: our own image
(localhost/kvwire-kafka:<version>) started by testcontainers, once per session, removed at the end.
.ci/containers.sh sets it for the container stage; without an engine that FAILS under CI=true."""

from __future__ import annotations

import os
from collections.abc import Iterator

from ci_env import unavailable

ENV = "KVWIRE_TEST_BROKER"


def requested() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "testcontainers"


def need_engine() -> None:
    from kvwire.kafka.broker.container import docker_available

    if not docker_available():
        where = os.environ.get("DOCKER_HOST") or "the default Docker socket"
        unavailable(f"{ENV}=testcontainers but no container engine answers on {where}")


def container_broker() -> Iterator[str]:
    """Yields the bootstrap of a freshly started container; removes it afterwards."""
    from kvwire.kafka.broker.container import DockerKafka

    need_engine()
    kafka = DockerKafka()
    try:
        bootstrap = kafka.start()
    except Exception as e:
        unavailable(f"testcontainers could not start {kafka.image}: {e}")
    try:
        yield bootstrap
    finally:
        kafka.stop()
