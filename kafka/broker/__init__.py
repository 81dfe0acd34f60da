"""A real Kafka broker for every dev run, test and CI job.

`resolve_bootstrap()` picks, in order: $KAFKA_BOOTSTRAP_SERVERS, a testcontainer when a Docker engine
answers, else the Maven-resolved `LocalKafka` (left running for later runs; `kvwire kafka stop` ends it).
$KVWIRE_KAFKA_BACKEND=local|docker forces one of the last two.
"""

from __future__ import annotations

import atexit
import logging
import os

from .container import DockerKafka, docker_available
from .local import BrokerError, LocalKafka, Status, default_home, default_port

__all__ = [
    "BrokerError",
    "DockerKafka",
    "LocalKafka",
    "Status",
    "default_home",
    "default_port",
    "docker_available",
    "resolve_bootstrap",
]

log = logging.getLogger("kvwire.kafka.broker")
_containers: list[DockerKafka] = []


def _stop_containers() -> None:
    for c in _containers:
        c.stop()


def resolve_bootstrap() -> str:
    """Bootstrap servers of a broker that answers; raises BrokerError saying why none could be had."""
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "").strip()
    if env:
        return env
    backend = os.environ.get("KVWIRE_KAFKA_BACKEND", "auto")
    errors = []
    if backend in ("auto", "docker") and docker_available():
        try:
            dk = DockerKafka()
            bootstrap = dk.start()
            _containers.append(dk)
            if len(_containers) == 1:
                atexit.register(_stop_containers)
            return bootstrap
        except Exception as e:  # an engine that answers ping can still fail to pull/run
            errors.append(f"docker: {e}")
            log.warning("testcontainers Kafka failed (%s); trying the local broker", e)
    if backend in ("auto", "local"):
        try:
            return LocalKafka().start()
        except Exception as e:
            errors.append(f"local: {e}")
    raise BrokerError("no Kafka broker: " + ("; ".join(errors) or f"backend {backend!r} unavailable"))
