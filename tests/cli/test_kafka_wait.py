"""`kvwire kafka wait`: the readiness wait compose services run before their command."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
from kafka_admin import delete_topics, free_port_pair

from kvwire.kafka.broker.probe import run_sync


def _wait(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvwire.cli", "kafka", "wait", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.integration
def test_wait_returns_and_creates_the_topic(kafka_bootstrap):
    topic = f"t-wait-{uuid.uuid4().hex[:8]}"
    try:
        r = _wait("-b", kafka_bootstrap, "--topic", topic, "--partitions", "3", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert f"'{topic}': 3" in r.stderr
        # A second wait finds the topic as it is: existing topics are never re-created or resized.
        r = _wait("-b", kafka_bootstrap, "--topic", topic, "--partitions", "5", "--timeout", "60")
        assert r.returncode == 0, r.stderr
        assert f"'{topic}': 3" in r.stderr
    finally:
        run_sync(lambda: delete_topics(kafka_bootstrap, [topic]))


def test_wait_gives_up_on_a_closed_port():
    port = free_port_pair()  # nothing listens there
    r = _wait("-b", f"127.0.0.1:{port}", "--timeout", "2", timeout=60)
    assert r.returncode == 1
    assert "not ready after 2s" in r.stderr
