"""The clear_rank step (bench/clear_rank.py) at its smoke size: the run checks its own answers (the
cleared worker credited nothing, then everything once it stores again), the core's sweep finishes,
and the harness summarizes it. No timed assertions: the figures live in bench/results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import report, run

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_run_clears_sweeps_and_restores(tmp_path) -> None:
    env = dict(os.environ, KVWIRE_BENCH_RESULTS=str(tmp_path), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "bench.clear_rank", "--smoke"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "clear_rank.json").read_text())
    assert res["answers_ok"] is True
    assert res["cleared_rank_blocks"] == 8_192 and len(res["rounds"]) == 3
    for r in res["rounds"]:
        assert r["credited_after_clear"] == 0 and r["credited_after_restore"] == 8_192
        # 8k slots at a bounded purge per apply: the sweep spans several applies, and ends.
        assert r["sweep_applies"] > 1
    s = run.summarize({"clear_rank": res}, {})
    assert s["clear_rank_ms_1m_blocks"] == res["clear_rank_ms_1m_blocks"]
    assert "8,192 blocks" in s["notes"]["clear_rank_ms_1m_blocks"]


def test_bench_runs_the_clear_of_its_mode() -> None:
    by_mode = {m: {n: a for n, a, _ in run.steps(m, "b:9092")} for m in ("full", "quick", "smoke")}
    assert by_mode["full"]["clear_rank"] == ["-m", "bench.clear_rank"]
    assert by_mode["quick"]["clear_rank"] == ["-m", "bench.clear_rank", "--quick"]
    assert by_mode["smoke"]["clear_rank"] == ["-m", "bench.clear_rank", "--smoke"]
    assert "clear_rank" in run.BROKERLESS and "clear_rank_ms_1m_blocks" in report.TARGETS
