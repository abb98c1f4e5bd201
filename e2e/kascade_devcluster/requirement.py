"""What a test does when something it needs is absent: skip locally with the reason, fail in CI.

CI (CI=true) installs every requirement, so a skip there would hide a broken install step.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def unavailable(reason: str) -> NoReturn:
    """Skip the calling test (locally) or fail it (in CI), naming what is missing."""
    if in_ci():
        pytest.fail(f"required in CI but unavailable: {reason}")
    pytest.skip(reason)


def need_transport(name: str) -> str:
    """`name` (an engine --transport), after making sure it can run here: ucx needs ucxx importable."""
    if name == "ucx":
        try:
            import ucxx  # noqa: F401
        except ImportError as e:
            unavailable(f"ucxx not importable: {e}")
    return name
