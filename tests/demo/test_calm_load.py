"""The demo's calm phase ends at the service's min on any machine (pure): its one client's most tokens/s, reached
when answers take no time, is below the scale-down bound at two replicas for every model the demo offers."""

from __future__ import annotations

import pytest

from kascade_demo.scenario import CALM_THINK_S, MAX_TOKENS, MODELS


@pytest.mark.parametrize("model", sorted(MODELS))
def test_the_calm_load_per_replica_at_two_replicas_is_below_the_lower_bound(model: str) -> None:
    m = MODELS[model]
    most = (m.prompt_tokens + MAX_TOKENS) / CALM_THINK_S  # one request per think time at best
    assert most / 2 < m.lower, (model, most, m.lower)  # was 80 / 2 = 40 for tiny at 0.5 s: on the bound
