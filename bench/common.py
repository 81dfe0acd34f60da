"""Shared helpers for benchmarks: where results go and how they are stamped."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(os.environ.get("KVWIRE_BENCH_RESULTS", Path(__file__).parent / "results"))


def cpu_model() -> str:
    """The CPU's model name. Sessions run on different machines: an earlier one hashed a query's
    8k tokens in 6.6 us at p50 (index_memory's hashing_only), an AMD EPYC 11.1, so a figure is
    compared with another only where both name the same CPU (or as a ratio measured in one run)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def write_result(name: str, data: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamped = dict(data)
    stamped.setdefault(
        "_machine",
        {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(stamped, indent=2) + "\n")
    return path


def percentiles(samples, ps=(50, 99, 99.9)) -> dict:
    """Nearest-rank percentiles of a list of numbers, keyed like 'p50'."""
    s = sorted(samples)
    if not s:
        return {f"p{p:g}": None for p in ps}
    return {f"p{p:g}": s[min(len(s) - 1, int(len(s) * p / 100))] for p in ps}
