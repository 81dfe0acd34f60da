"""The benchmark harness runs end to end against a real broker with tiny sizes and writes every
summary key. No timed assertions: speed lives in bench/results, not in tests."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.run import SUMMARY_KEYS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_bench_smoke_writes_every_summary_key(kafka_bootstrap, tmp_path):
    env = dict(os.environ, KVWIRE_BENCH_RESULTS=str(tmp_path))
    p = subprocess.run(
        [sys.executable, "-m", "bench", "--smoke", "--bootstrap", kafka_bootstrap],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert tuple(summary) == SUMMARY_KEYS
    notes = summary["notes"]
    for k in SUMMARY_KEYS[:-1]:
        v = summary[k]
        assert v is None or isinstance(v, (int, float)), (k, v)
        if v is None:
            assert k in notes and notes[k].startswith("null:"), (k, notes)
    # every step's JSON and each curve's plot landed in the results folder
    steps = ["codec", "publish_cost", "index_memory", "apply_rate", "score_latency", "lag", "clear_rank", "soak"]
    if importlib.util.find_spec("bench.replay") is not None:
        steps.append("replay")
    for name in steps:
        assert (tmp_path / f"{name}.json").exists(), name
    assert (tmp_path / "table.md").read_text().count("\n|") >= 8
    for png in ("lag", "score_latency", "apply_rate", "publish_cost", "codec", "index_memory", "soak"):
        assert (tmp_path / f"{png}.png").stat().st_size > 0, png


def test_summary_maps_every_key_even_when_nothing_ran():
    from bench.run import summarize

    s = summarize({}, {"lag": "timed out after 1 s"})
    assert tuple(s) == SUMMARY_KEYS
    assert all(s[k] is None for k in SUMMARY_KEYS[:-1])
    assert "timed out" in s["notes"]["lag_p99_ms"]
