from __future__ import annotations

import pytest

from tests.engine.helpers import Artifacts


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> Artifacts:
    """Tiny models and adapters, built on first use and shared by every engine test."""
    return Artifacts(tmp_path_factory.mktemp("engine-artifacts"))
