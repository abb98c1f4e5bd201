"""kascade_operator package."""
