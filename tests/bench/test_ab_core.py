"""bench.ab_core, the A/B of two core builds DESIGN.md quotes, runs as its docs show (here a
build against itself, small): every row it prints, for top 16, every matched worker and keys
given, comes with a ratio per pair. No timed assertions: it is a harness check."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvwire import _core

ROOT = Path(__file__).resolve().parents[2]


def test_ab_core_prints_every_row_with_a_ratio_per_pair():
    core = _core.__file__
    assert core is not None
    cmd = [sys.executable, "-m", "bench.ab_core", core, core, "--size", "200000", "--queries", "30"]
    p = subprocess.run(
        cmd + ["--apply-blocks", "5000", "--pairs", "2"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert len(re.findall(r"^pair \d+: ", p.stdout, re.M)) == 2
    rows = {name: ratios for name, ratios in re.findall(r"^  (\S+)\s+x\d+\.\d+  \(([^)]*)\)$", p.stdout, re.M)}
    kinds = ("stored_conversation", "system_prompt_then_new", "miss")
    want = {"apply_blocks_per_s", "churn_apply_us_per_record"} | {
        f"{m}.{k}" for m in ("top16", "all", "keys_top16") for k in ("p50", "p99", *(f"p50_{x}" for x in kinds))
    }
    assert set(rows) == want
    assert all(len(r.split(", ")) == 2 for r in rows.values())
