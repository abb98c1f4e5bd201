"""Kascade's main job on one machine: `kascade demo` (see scenario.py) and its record (timeline.py)."""
