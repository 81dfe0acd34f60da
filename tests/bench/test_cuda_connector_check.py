"""bench/cuda_connector_check.py with ``--device cpu``: a real LMCacheEngine evicting while it
stores, kvwire's LMCache source, the Avro codec and the Rust-core applier (no broker), every
credit checked against ``LMCacheEngine.lookup`` and the retrieved KV bytes against what was stored.
The script checks its own answers; this runs it at its default sizes, incremental stores (the
default) and whole ones (``--mask none``), and reads its summary. The last CUDA run is
bench/results/cuda_check.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ci_env import require

pytestmark = pytest.mark.lmcache

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "cuda_connector_check.py"
# Seed 2's incremental stores make LMCache evict a chunk's parent just before the chunk goes in:
# the case a worker's memo of removed parents exists for (4 under-credited queries without it).
RUNS = {"default": ["--seed", "2"], "mask_none": ["--mask", "none", "--seed", "12"]}
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Both runs start at once (each waits seconds on LMCache's start-up); each test waits for its own."""
    require("torch")
    require("lmcache.v1.cache_engine")
    out = tmp_path_factory.mktemp("cuda_check")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("OUT", None)  # --out below; nothing lands in the tree
    procs = {}
    for name, extra in RUNS.items():
        log = out / f"{name}.log"
        with log.open("w") as f:
            cmd = [sys.executable, str(SCRIPT), "--device", "cpu", *extra, "--out", str(out / f"{name}.json")]
            procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    yield {name: (p, out / f"{name}.json", out / f"{name}.log") for name, p in procs.items()}
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("name", list(RUNS))
def test_index_equals_lookup_and_kv_round_trips_on_cpu(runs: dict, name: str) -> None:
    p, summary_path, log_path = runs[name]
    try:
        rc = p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail(f"{name}: still running after {TIMEOUT_S} s\n{log_path.read_text()[-3000:]}")
    log = log_path.read_text()
    assert rc == 0, f"{name}: exit {rc}\n{log[-3000:]}"
    s = json.loads(summary_path.read_text())
    assert s["ok"] is True and s["problems"] == [], s.get("problems") or s.get("error")
    assert s["mismatches"] == 0 and s["orphan_mismatches"] == 0
    assert all(c["mismatches"] == 0 for c in s["checks"]) and s["checks"][-1]["label"] == "final"
    assert s["records_applied"] > 0 and s["records_applied"] == s["records"]
    assert s["removals"] > 0  # LMCache evicted while it stored, and the index heard of it
    assert s["gaps"] == 0 and s["dead_letters"] == 0
    assert s["retrieved_prompts"] > 0 and s["bytes_checked"] > 0
    assert s["byte_mismatches"] == 0 and s["retrieve_mismatches"] == 0
    if name == "mask_none":
        assert s["mask"] == "none" and s["masked_stores"] == 0
    else:
        assert s["mask"] == "lookup" and s["masked_stores"] > 0
