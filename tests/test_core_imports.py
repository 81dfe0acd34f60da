"""The core pipeline never imports the engines: torch, lmcache and vllm stay optional extras."""

import subprocess
import sys

CORE = [
    "kvwire.schemas",
    "kvwire.schemas.codec",
    "kvwire.producer.publisher",
    "kvwire.producer.simulator",
    "kvwire.producer.vllm_wire",
    "kvwire.producer.zmq_bridge",
    "kvwire.consumer.apply",
    "kvwire.consumer.ingest",
    "kvwire.consumer.index",
    "kvwire.consumer.http",
    "kvwire.consumer.snapshot",
    "kvwire.consumer.replay",
    "kvwire.cli",
]


def test_core_modules_do_not_import_engines():
    code = (
        f"import importlib, sys\nfor m in {CORE!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in ('torch', 'lmcache', 'vllm') if m in sys.modules)\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"core pipeline imported {out.stdout.strip()}"
