"""Shared fixtures. Integration tests take `kafka_bootstrap`: a real broker, never a fake one.

Without a broker they skip locally but FAIL under CI=true, so CI can never go green by skipping."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest
import tc_broker
from ci_env import unavailable
from kafka_admin import create_topics, delete_topics

from kvwire.kafka.broker.probe import run_sync


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # `-m "not integration"` must deselect every test that needs a broker, marked by hand or not.
    for item in items:
        if "kafka_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def kafka_bootstrap() -> Iterator[str]:
    # A LocalKafka started here is left running for the next session (.ci/run stops it);
    # env-provided brokers are never touched, testcontainers are removed at interpreter exit.
    # KVWIRE_TEST_BROKER=testcontainers: our broker image in a container, removed after the session.
    if tc_broker.requested():
        yield from tc_broker.container_broker()
        return
    from kvwire.kafka.broker import resolve_bootstrap

    try:
        bootstrap = resolve_bootstrap()
    except Exception as e:
        reason = f"no Kafka broker could be had: {e}"
        unavailable(reason)
    yield bootstrap


@pytest.fixture
def new_topic(kafka_bootstrap: str, request: pytest.FixtureRequest) -> Callable[..., str]:
    """Factory: `new_topic(partitions=4, config={...})` -> name of a fresh, empty topic.
    Sync so it works in sync and async tests alike; topics are deleted after the test, with the
    `.dlq` and `.snapshots` topics kvwire made beside them."""
    created: list[str] = []
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]

    def make(partitions: int = 1, config: dict[str, str] | None = None) -> str:
        name = f"t-{stem}-{uuid.uuid4().hex[:8]}"
        run_sync(lambda: create_topics(kafka_bootstrap, [name], partitions, config))
        created.append(name)
        return name

    yield make
    if created:
        try:
            run_sync(lambda: delete_topics(kafka_bootstrap, created, derived=True))
        except Exception:
            pass  # cleanup only: a leftover topic on a dev broker harms nothing


@pytest.fixture
def topic_name(new_topic: Callable[..., str]) -> str:
    """A fresh single-partition topic."""
    return new_topic()
