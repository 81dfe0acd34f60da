"""tests/containers/ runs in CI's container stage (.ci/containers.sh sets KVWIRE_TEST_BROKER);
in the main pytest stage, which has no container engine by design, it is skipped with that reason."""

from __future__ import annotations

import pytest
import tc_broker


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if tc_broker.requested():
        return
    skip = pytest.mark.skip(reason=f"container tests run with {tc_broker.ENV}=testcontainers (.ci/containers.sh)")
    for item in items:
        if "tests/containers/" in str(item.path).replace("\\", "/"):
            item.add_marker(skip)
