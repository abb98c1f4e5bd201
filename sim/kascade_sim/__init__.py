"""kascade_sim package."""
