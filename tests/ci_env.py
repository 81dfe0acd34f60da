"""The one rule for "are we in CI?" and what a missing prerequisite does there.

Under CI=true every prerequisite (broker, engines, java, a container engine) is installed by
.ci/run, so a missing one is a broken CI and FAILS; locally it skips, with the reason."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> NoReturn:
    """Fail under CI, skip elsewhere."""
    if in_ci():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def need_java_and_mvn(what: str = "a private broker") -> None:
    if not (shutil.which("java") and shutil.which("mvn")):
        unavailable(f"{what} needs java and mvn (CI has them)")


def require(module: str) -> ModuleType:
    """importorskip locally; under CI=true the engines and routers are installed, so a missing one FAILS."""
    try:
        return importlib.import_module(module)
    except Exception as e:
        unavailable(f"{module} is not installed (CI installs it): {e}")
