"""The schema registry tests run against: a real one, never a stand-in.

KVWIRE_SCHEMA_REGISTRY_URL names an existing registry (used, never touched); otherwise the
session starts kvwire's own local Apicurio Registry (kvwire.kafka.registry.local, the same code as
`kvwire registry start`). Like the local Kafka it is left running for the next session on a dev
box (other sessions may be using it by then); under CI=true the session that started it stops it.
Under CI=true a registry that cannot be had FAILS the tests that need it. Import the fixture by name into a test module or
conftest (`from schema_registry import schema_registry`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from ci_env import in_ci, need_java_and_mvn, unavailable


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[str]:
    """The registry's Confluent-compatible base URL."""
    from kvwire.kafka.registry.client import ENV_URL
    from kvwire.kafka.registry.local import LocalRegistry

    url = os.environ.get(ENV_URL)
    if url:
        yield url
        return
    need_java_and_mvn("the local schema registry")
    reg = LocalRegistry()
    started_here = not reg.status().running
    try:
        url = reg.start()
    except Exception as e:
        unavailable(f"no schema registry could be started: {e}")
    yield url
    if started_here and in_ci():
        reg.stop()


def fresh_subject(stem: str) -> str:
    return f"t-{stem}-{uuid.uuid4().hex[:8]}-value"
