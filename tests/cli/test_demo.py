"""`kvwire demo` end to end, as a new user runs it: a real broker, the real command in its own
process, its exit status and its summary."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

WORKERS, PARTITIONS, MEMBERS = 4, 4, 2


def run_demo(env: dict[str, str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "kvwire.cli", "demo", "--seconds", "4", "--rate", "40"]
    args += ["--workers", str(WORKERS), "--partitions", str(PARTITIONS), "--members", str(MEMBERS)]
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


def test_demo_runs_and_its_summary_holds(kafka_bootstrap):
    from kvwire.kafka.broker import default_port

    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="80")
    local = kafka_bootstrap == f"127.0.0.1:{default_port()}"
    if local:
        env.pop("KAFKA_BOOTSTRAP_SERVERS", None)  # as a user runs it, with the local broker already up
    else:
        env["KAFKA_BOOTSTRAP_SERVERS"] = kafka_bootstrap
    proc = run_demo(env)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    if local:
        assert "already running" in out and "starting Kafka" not in out
    # The members really split the partitions: each owns some, none twice, all owned.
    m = re.search(r"group assignment: (.*)", out)
    assert m, out
    owned = [[int(p) for p in re.findall(r"\d+", part)] for part in re.findall(r"\[([\d, ]*)\]", m.group(1))]
    assert len(owned) == MEMBERS and all(owned), m.group(1)
    assert sorted(p for ps in owned for p in ps) == list(range(PARTITIONS))
    # No library log line among the progress lines; the summary says where they went.
    assert not re.search(r"\b(WARNING|ERROR)\b|aiokafka", out), out
    summary = out.split("kvwire demo summary", 1)[1]
    assert f"{WORKERS}/{WORKERS} workers exact after drain" in summary
    assert re.search(r"producer\s+\d+ records acked, 0 dropped", summary)
    assert "in-process lag" in summary and "bench.lag" in summary
    hit = float(re.search(r"hit rate vs oracle\s+([\d.]+)%", summary).group(1))
    assert 0 < hit <= 100
