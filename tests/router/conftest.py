"""The router tests' shared helpers (pdtrio.py) are importable by name: the suite runs with
--import-mode=importlib, which does not put test folders on sys.path (tests/engine/conftest.py does the same)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
