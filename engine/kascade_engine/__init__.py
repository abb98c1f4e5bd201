"""kascade_engine package."""
