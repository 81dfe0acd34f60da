from __future__ import annotations

from collections.abc import Iterator

import pytest
from schema_registry import schema_registry  # noqa: F401  (the session fixture, by name)

from kvwire.schemas.codec import SCHEMA_IDS


@pytest.fixture(autouse=True)
def _fresh_id_cache() -> Iterator[None]:
    # The process-wide id cache outlives tests; each test here resolves its ids itself.
    SCHEMA_IDS.clear()
    yield
    SCHEMA_IDS.clear()
