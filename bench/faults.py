"""Fault measurements: runs the fault suite (tests/faults) with its results pointed at
bench/results/faults.json — records in flight at the fault, acknowledged records lost, time to
converge. The tests assert correctness; this only collects what they measured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None, results: Path | None = None) -> int:
    out = (results or ROOT / "bench" / "results") / "faults.json"
    env = {**os.environ, "KVWIRE_FAULT_RESULTS": str(out)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", *(argv or [])]
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
