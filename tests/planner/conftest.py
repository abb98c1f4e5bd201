"""The planner tests' `scenario` fixture (the builder itself is scenarios.py, imported by name)."""

from __future__ import annotations

import pytest
from scenarios import Scenario


@pytest.fixture
def scenario() -> Scenario:
    return Scenario()
