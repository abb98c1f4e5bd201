"""Run a bench with the project's interpreter: `python bench/x.py` from a shell without the venv active re-executes
itself with the checkout's `.venv/bin/python` (made by `make install`), where the project's packages are installed.

Data flow: `ensure()` at the top of a bench, before its project imports -> the project importable: nothing; else
`.venv/bin/python` exists: exec it with the same arguments; else exit 2 naming `make install`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

VENV_PYTHON = Path(__file__).resolve().parents[1] / ".venv" / "bin" / "python"


def ensure(package: str = "kascade_planner") -> None:
    if importlib.util.find_spec(package) is not None:
        return
    # the venv's python is a symlink to the base interpreter: which venv runs is sys.prefix, not the binary
    if VENV_PYTHON.exists() and Path(sys.prefix).resolve() != VENV_PYTHON.parents[1].resolve():
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
    sys.exit(f"{package} is not importable by {sys.executable}: run `make install` (it makes {VENV_PYTHON})")
