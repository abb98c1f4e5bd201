"""Operator test setup: makes `builders` (spec/pod helpers) importable from the test modules
(pytest runs in importlib mode, so the test folder is not on sys.path by itself)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
