"""The operator's Prometheus metrics source (metrics_source=prometheus): its PromQL answers become the same
per-instance loads the direct Scraper gives, including the decode-only step time a converted decoder's
chunk budget is sized with (without it the budget falls back to half the TBT objective), and the
velocities the engines measured (the tokenVelocity policy's inputs; an engine that measured none has none)."""

from __future__ import annotations

from typing import Any, TypeAlias

import httpx
import pytest
from promfake import prometheus

from kascade_operator.metrics import MetricsError, PrometheusSource, measured, snapshot
from kascade_planner.policies import MeasuredVelocity

# per pod: a value, None (no row), or {bucket: value} (rows per prompt-length bucket, for `by (pod, bucket)`)
Held: TypeAlias = float | dict[str, float] | None

# what the fake Prometheus holds per pod, by the metric a query reads (its answer for either pod)
HELD: dict[str, tuple[Held, Held]] = {
    "kascade_prompt_tokens_total": (300.0, 100.0),
    "kascade_generation_tokens_total": (40.0, 60.0),
    "kascade_num_requests_waiting": (2.0, 0.0),
    "kascade_num_requests_running": (3.0, 5.0),
    "kascade_kv_cache_usage_perc": (0.5, 0.25),
    "kascade_time_to_first_token_seconds_sum": (1.0, 3.0),
    "kascade_time_to_first_token_seconds_count": (4.0, 4.0),
    "kascade_inter_token_latency_seconds_sum": (0.5, 0.5),
    "kascade_inter_token_latency_seconds_count": (10.0, 40.0),
    "kascade_step_seconds_sum": (0.6, 1.8),
    "kascade_step_seconds_count": (60.0, 60.0),
    # arrivals/s, and finished requests' output tokens (the same answer for the window and lifetime queries)
    "kascade_requests_arrived_total": (4.0, 6.0),
    "kascade_request_generation_tokens_sum": (300.0, 500.0),
    "kascade_request_generation_tokens_count": (10.0, 6.0),
    # velocity gauges: d1 has measured nothing yet (Prometheus drops its 0s with `> 0`: no row)
    "kascade_prefill_velocity_tokens_per_second": ({"512": 900.0}, None),
    "kascade_prefill_velocity_floor_tokens_per_second": (300.0, None),  # d0 has a capacity: its floor is out
    "kascade_decode_velocity_tokens_per_second": (120.0, None),
    "kascade_kv_link_tokens_per_second": (5000.0, None),
    "kascade_prefill_rate_tokens_per_second": (450.0, None),
    # prompt tokens/s arriving per length bucket: none from these pods (older engines)
    "kascade_prompt_tokens_arrived_total": (None, None),
}


def _prometheus(seen: list[str], held: dict[str, tuple[Held, Held]] = HELD) -> httpx.AsyncClient:
    def answer(q: str) -> list[dict[str, Any]]:
        (name,) = [n for n in held if f"{n}{{" in q]
        if name.startswith("kascade_step_seconds") and 'kind="decode"' not in q:
            return []  # all kinds: wrong
        if "velocity" in name or "link" in name or "rate" in name:
            assert "> 0" in q and q.startswith(("max by (pod, bucket)", "max by (pod)", "avg by (pod)")), q
        rows: list[dict[str, Any]] = []
        for pod, v in zip(("d0", "d1"), held[name], strict=True):
            if isinstance(v, dict):
                assert "by (pod, bucket)" in q, q
                rows += [{"metric": {"pod": pod, "bucket": b}, "value": [0, str(x)]} for b, x in v.items()]
            elif v is not None:
                rows.append({"metric": {"pod": pod}, "value": [0, str(v)]})
        return rows

    return prometheus(answer, seen)


async def test_prometheus_gives_the_decode_only_step_time() -> None:
    seen: list[str] = []
    src = PrometheusSource("http://prom:9090", window="1s", client=_prometheus(seen))
    try:
        loads = await src.collect(["d0", "d1"])
    finally:
        await src.aclose()
    d0, d1 = loads
    assert (d0.input_tokens_per_s, d0.in_flight, d0.queue_length) == (300.0, 5, 2.0)
    assert (d0.decode_step_sum, d0.decode_step_count, d1.decode_step_sum) == (0.6, 60.0, 1.8)
    snap = snapshot(loads, 0.0)
    assert snap.decode_step_s == pytest.approx((0.6 + 1.8) / 120)  # the decoders' mean decode-only step
    assert any('kind="decode"' in q and "[1s]" in q for q in seen)
    # decode demand as the Scraper's: 10 req/s arriving x (300 + 500) / 16 tokens pooled = 500 > 100 measured
    assert snap.requests_per_s == 10.0 and snap.output_length is not None and snap.output_length.mean == 50.0
    assert snap.decode_demand.tokens_per_s == 500.0
    assert any(q.startswith("sum by (pod) (increase(kascade_request_generation_tokens_count{") and "[1s]" in q
               for q in seen)


async def test_prometheus_gives_the_engines_measured_velocities() -> None:
    src = PrometheusSource("http://prom:9090", client=_prometheus([]))
    try:
        d0, d1 = await src.collect(["d0", "d1"])
    finally:
        await src.aclose()
    # 450: the prefill rate it achieved
    assert d0.velocity == MeasuredVelocity(900.0, 120.0, 5000.0, 450.0, 900.0, (("512", 900.0),))
    assert d1.velocity is None  # measured nothing: the policy falls back to its typed velocities
    assert measured([d0, d1]) == MeasuredVelocity(900.0, 120.0, 5000.0, 450.0, 900.0, (("512", 900.0),))


async def test_before_a_saturated_step_the_prefill_velocity_is_the_best_floor() -> None:
    """An engine with no saturated prefill step yet reports capacities of 0 (no row past `> 0`): its prefill
    velocity is its best unsaturated step, as the Scraper reads it (kascade_planner.prefillvelocity)."""
    held: dict[str, tuple[Held, Held]] = {**HELD, "kascade_prefill_velocity_tokens_per_second": (None, None),
            "kascade_prefill_velocity_floor_tokens_per_second": (200.0, None)}
    seen: list[str] = []
    src = PrometheusSource("http://prom:9090", client=_prometheus(seen, held))
    try:
        d0, d1 = await src.collect(["d0", "d1"])
    finally:
        await src.aclose()
    assert d0.velocity == MeasuredVelocity(200.0, 120.0, 5000.0, 450.0) and d1.velocity is None
    assert any(q.startswith("max by (pod) (kascade_prefill_velocity_floor_tokens_per_second{") for q in seen)


async def test_a_failed_query_names_prometheus() -> None:
    client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda req: httpx.Response(400, json={"status": "error", "error": "bad_data: parse error"})))
    src = PrometheusSource("http://prom:9090", client=client)
    try:
        with pytest.raises(MetricsError, match=r"prometheus http://prom:9090: query .* failed: bad_data"):
            await src.collect(["d0"])
    finally:
        await src.aclose()
