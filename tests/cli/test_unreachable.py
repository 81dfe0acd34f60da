"""Every command, pointed at something that does not answer, fails in one line that names what it
could not reach and where: no traceback, no "Unclosed AIOKafka..." warning, a non-zero exit.

Each runs the real entry point in its own process against a closed loopback port (nothing
listens there, so a connection is refused at once: no test waits on a timeout)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from kafka_admin import free_port_pair

# Variables that would point a command somewhere else than the arguments say.
_ENV = ("KAFKA_BOOTSTRAP_SERVERS", "KVWIRE_KAFKA_CONFIG", "KVWIRE_SCHEMA_REGISTRY_URL", "KVWIRE_FRAMING")


def _closed() -> str:
    return f"127.0.0.1:{free_port_pair()}"


def kvwire(*args: str, home: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _ENV}
    env["COLUMNS"] = "200"  # a rich-formatted message must not wrap into several lines here
    if home:
        env["KVWIRE_REGISTRY_HOME"] = home
    return subprocess.run(
        [sys.executable, "-m", "kvwire.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def assert_one_line(r: subprocess.CompletedProcess, *names: str) -> str:
    out = r.stdout + r.stderr
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert r.returncode != 0, out
    assert "Traceback" not in out and "Unclosed" not in out, out
    assert len(lines) == 1, out
    for name in names:
        assert name in lines[0], out
    return lines[0]


def _bridge(command: str, bootstrap: str, *extra: str) -> subprocess.CompletedProcess:
    zmq = f"tcp://127.0.0.1:{free_port_pair()}"
    return kvwire(command, "--zmq-endpoint", zmq, "--instance-id", "w", "-b", bootstrap, "-t", "t", *extra)


KAFKA_COMMANDS = {
    "index": lambda b: kvwire("index", "-b", b, "--http", "127.0.0.1:0"),
    "replay": lambda b: kvwire("replay", "-b", b, "-t", "t"),
    "replay --from snapshot": lambda b: kvwire("replay", "-b", b, "--from", "snapshot"),
    "tail": lambda b: kvwire("tail", "-b", b, "-t", "t", "--from", "earliest"),
    "bridge": lambda b: _bridge("bridge", b),
    "sglang-bridge": lambda b: _bridge("sglang-bridge", b),
    "demo": lambda b: kvwire("demo", "-b", b, "--seconds", "1"),
    "kafka wait": lambda b: kvwire("kafka", "wait", "-b", b, "--timeout", "1"),
}


@pytest.mark.parametrize("command", sorted(KAFKA_COMMANDS))
def test_a_dead_broker_is_one_line(command: str):
    bootstrap = _closed()
    line = assert_one_line(KAFKA_COMMANDS[command](bootstrap), bootstrap)
    assert "Kafka" in line


def test_schemas_register_with_a_dead_registry_is_one_line():
    url = f"http://{_closed()}"
    line = assert_one_line(kvwire("schemas", "--register", url), url)
    assert line.startswith("kvwire schemas --register: cannot reach the schema registry")


def test_a_bridge_with_a_dead_registry_is_one_line():
    # Checked before the broker (which is dead here too): the registry is named, not Kafka.
    url = f"http://{_closed()}"
    r = _bridge("bridge", _closed(), "--framing", "confluent", "--schema-registry-url", url)
    assert "schema registry" in assert_one_line(r, url)


def test_registry_status_of_a_dead_registry_is_one_line(tmp_path):
    port = free_port_pair()
    assert_one_line(kvwire("registry", "status", "--port", str(port), home=str(tmp_path)), f"127.0.0.1:{port}")


def test_a_bad_zmq_endpoint_is_one_line(kafka_bootstrap):
    r = kvwire(
        "bridge", "--zmq-endpoint", "nowhere", "--instance-id", "w", "-b", kafka_bootstrap, "--log-level", "ERROR"
    )
    assert_one_line(r, "ZMQ endpoint at nowhere")


def test_an_index_whose_http_port_is_taken_is_one_line(kafka_bootstrap, new_topic):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        http = f"127.0.0.1:{s.getsockname()[1]}"
        r = kvwire(
            "index", "-b", kafka_bootstrap, "-t", new_topic(), "--http", http, "--no-snapshots", "--log-level", "ERROR"
        )
    assert "cannot listen for HTTP" in assert_one_line(r, http)
