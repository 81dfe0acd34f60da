"""Real routers against a real ``kvwire index --event-streams`` process, fed through a real broker.

The routers are the released ones (``.ci/run`` installs them, see ../shared/reference/routers.md):
vllm-router 0.1.17 (a Rust binary) and Dynamo 1.6.1's ``python -m dynamo.indexer``. Under
CI=true a missing one fails (``tests/ci_env.py``); locally it skips."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from ci_env import unavailable


@pytest.fixture
def vllm_router_bin() -> str:
    path = shutil.which("vllm-router")
    if path is None:
        unavailable("vllm-router is not installed (CI installs vllm-router==0.1.17)")
    return path


@pytest.fixture
def dynamo_indexer() -> list[str]:
    try:
        found = importlib.util.find_spec("dynamo.indexer") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        unavailable("dynamo.indexer is not installed (CI installs ai-dynamo==1.6.1 --no-deps)")
    return [sys.executable, "-m", "dynamo.indexer"]


@pytest.fixture
def procs() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in reversed(started):
        p.stop()
