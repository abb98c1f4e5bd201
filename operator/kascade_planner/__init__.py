"""kascade_planner package."""
