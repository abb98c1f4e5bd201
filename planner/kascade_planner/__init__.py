"""Kascade's planner: pure functions of frozen dataclasses (stdlib + numpy/scipy only).

topology -> (chains | binomial | baselines) -> Plan -> cost (arrival times, lower bound);
zigzag (live cooperative execution schedules); policies (how many instances each role needs).
Used by the operator, the engine and the simulator alike.
"""
