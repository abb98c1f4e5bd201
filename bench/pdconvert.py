"""bench/pd.py's convertible setup, driven as the operator drives it: the service spec the policy reads
(`policy_spec`: the bench's SLOs, no typed velocities), the loop that scrapes both engines and applies the
operator's conversion policy to the decoder (`converter`), and each engine's step times by kind
(`step_times`: whether a converted decoder's budget bounded its steps).

Data flow: engines' /metrics -> kascade_operator Scraper/snapshot -> pdscaling.conversion_input ->
kascade_planner.conversion.plan_conversions -> the decoder's /convert + the router's convertible flag;
every sample and decision is appended to the caller's lists (they go into pd.json).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp


def policy_spec(model: str, tbt_slo: float, ttft_slo: float, prefill_velocity: float | None = None) -> Any:
    """The bench's service as the operator would read it: disaggregated, the bench's SLOs, tokenVelocity
    with NO typed velocities (the engines' measured ones are the only input), bounds 1..4 per role (the
    P:D ratio policy's room; the bench's engines stay 1 + 1, so its answer is recorded, not applied).
    `prefill_velocity` (a diagnostic run): typed into tokenVelocity.prefillTokensPerSecond, as a user may, in
    place of the engines' measured prefill velocity."""
    from kascade_operator.api import ModelServiceSpec

    scaling: dict[str, Any] = {"policy": "tokenVelocity"}
    if prefill_velocity is not None:
        scaling["tokenVelocity"] = {"prefillTokensPerSecond": prefill_velocity}

    return ModelServiceSpec.model_validate({
        "model": {"name": model, "source": {"path": "/models/pd"}, "layers": 8}, "engine": {"image": "kascade:dev"},
        "mode": "disaggregated", "replicas": {"prefill": {"min": 1, "max": 4}, "decode": {"min": 1, "max": 4}},
        "slo": {"ttftMs": ttft_slo * 1e3, "tbtMs": tbt_slo * 1e3}, "scaling": scaling})


async def step_times(url: str) -> dict[str, Any]:
    """One engine's steps by kind (kascade_step_seconds: count, mean ms) and the most prompt tokens one step
    prefilled under the budget in force at the end: whether a converted decoder's budget bounded its steps; and the
    PD counters: prompts prefilled for others, KV adopted, local fallbacks, prompts handed back (handback.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as s, s.get(f"{url}/metrics") as r:
        text = await r.text()
    out: dict[str, Any] = {}
    for f in text_string_to_metric_families(text):
        for x in f.samples:
            if x.name in ("kascade_step_seconds_count", "kascade_step_seconds_sum"):
                out.setdefault(x.labels["kind"], {})[x.name.rsplit("_", 1)[1]] = x.value
            elif x.name == "kascade_step_seconds_bucket":  # cumulative counts: how many steps took <= le
                out.setdefault(x.labels["kind"], {}).setdefault("le", {})[x.labels["le"]] = x.value
            elif x.name == "kascade_prefill_step_tokens_max":
                out["prefill_step_tokens_max"] = x.value
            elif x.name == "kascade_prefill_tokens_cut_by_step_budget_total":
                out["prefill_tokens_cut_by_step_budget"] = x.value
            elif x.name in ("kascade_pd_handbacks_total", "kascade_pd_prefills_served_total",
                            "kascade_pd_remote_prefills_total", "kascade_pd_local_fallbacks_total"):
                out[x.name.removeprefix("kascade_pd_").removesuffix("_total")] = x.value  # where prompts prefilled
            elif x.name == "kascade_step_cost_prompt_token_seconds":
                out["step_cost_prompt_token_ms"] = round(x.value * 1e3, 3)
    for v in out.values():
        if isinstance(v, dict) and v.get("count"):
            v["mean_ms"] = round(v["sum"] / v["count"] * 1e3, 2)
    return out


async def converter(decoder: Any, url: str, prefill_url: str, spec: Any, token: str, stop_at: asyncio.Event,
                    log: list[dict[str, Any]], samples: list[dict[str, Any]], apply: bool = True) -> None:
    """What the operator does for a disaggregated service (kascade_operator.converter), for the static
    router of this bench, with the operator's own code at every step but the kube API: every 0.25 s its
    Scraper reads both engines' /metrics (rates over the operator's default 1 s window), `snapshot` makes
    each role's MetricsSnapshot (with the velocities the engines measured online from their own steps:
    `kascade_prefill_velocity_tokens_per_second` etc.), `pdscaling.conversion_input` turns them into the
    policy's input exactly as for a ModelService (typed velocities none, so the measured ones), and
    `plan_conversions` decides; `pdscaling.velocities` + `pd_ratio` give the P:D ratio the same velocities
    ask for. A conversion is applied as the operator does it: the engine's /convert with the chunk and step budgets,
    then the router's convertible flag (the pod annotation's effect); taking back in reverse. Until an
    engine has measured a prefill velocity the policy holds (its rule for an unknown velocity).
    `apply` False: the same loop, scrapes and decisions, applying none (the disaggregated setup: the operator watches
    a service whatever its convertibleDecoders, and on this 2-core machine its scraping shares the cores with the
    engines: run in the convertible setup alone, that setup differed by more than the conversion)."""
    from kascade_operator.decide import RoleInput
    from kascade_operator.metrics import Scraper, snapshot
    from kascade_operator.pdscaling import conversion_input, demand, velocities
    from kascade_operator.pool import PodView
    from kascade_planner.conversion import plan_conversions
    from kascade_planner.engine_api import ConvertRequest
    from kascade_planner.pdratio import PdVelocity, pd_ratio
    from kascade_planner.policies import Bounds

    hdr = {"Authorization": f"Bearer {token}"}
    scraper = Scraper(timeout_s=1.0, window_s=1.0)
    eps = {"prefill": {"p0": prefill_url.removeprefix("http://")}, "decode": {decoder.pod: url.removeprefix("http://")}}
    try:
        async with aiohttp.ClientSession() as s:
            while not stop_at.is_set():
                now = time.monotonic()
                roles = []
                for role, ep in eps.items():
                    loads = await scraper.collect(ep, group=role)
                    roles.append(RoleInput(role, len(loads), 1, 4, snapshot(loads, now)))
                pods = [
                    PodView("p0", "n0", "1", True, "svc", "prefill", True, endpoint=eps["prefill"]["p0"]),
                    PodView(
                        decoder.pod,
                        "n0",
                        "1",
                        True,
                        "svc",
                        "decode",
                        True,
                        endpoint=eps["decode"][decoder.pod],
                        convertible=decoder.convertible,
                    ),
                ]
                inp = conversion_input(spec, "svc", pods, roles)
                assert inp is not None
                c = plan_conversions(inp)
                v = velocities(spec, [r.snap for r in roles])
                ratio = None
                if v.prefill and v.decode:
                    ratio = pd_ratio(demand(roles), PdVelocity(v.prefill, v.network or v.prefill, v.decode),
                                     Bounds(1, 4), Bounds(1, 4))
                samples.append({"t": round(now, 2), "input_tokens_per_s": round(inp.input_tokens_per_s, 1),
                                "prefill_queue": inp.prefill_queue, "decode_step_s": inp.decode_step_s,
                                "velocity": {"prefill": v.prefill, "network": v.network, "decode": v.decode},
                                # the conversion policy's: a prefiller's capacity only (None before a saturated step)
                                "conversion_prefill_velocity": inp.prefill_tokens_per_s,
                                "converted": decoder.convertible, "chunk_tokens": c.chunk_tokens,
                                # prompt tokens/s each role actually prefilled (its engines' gauges), the share
                                # the policy took from them, and the decoder's rate as the router last heard it
                                "prefill_rate": {r.role: r.snap.measured.prefill_rate_tokens_per_s if r.snap.measured
                                                 else None for r in roles},
                                "converted_share": inp.converted_share, "router_decoder_rate": decoder.prefill_rate,
                                "pd_ratio": None if ratio is None else [ratio.prefill, ratio.decode]})
                if not apply:
                    pass
                elif c.convert:
                    ms = None if c.step_budget_s is None else c.step_budget_s * 1e3
                    hb = None if c.hand_back_s is None else c.hand_back_s * 1e3  # from the TTFT SLO, as the operator
                    async with s.post(f"{url}/kascade/v1/convert",
                                      json=ConvertRequest(c.chunk_tokens, ms, hb).to_dict(), headers=hdr) as r:
                        r.raise_for_status()
                    decoder.convertible = True
                elif c.revert:
                    decoder.convertible = False
                    async with s.post(f"{url}/kascade/v1/convert", json=ConvertRequest(None).to_dict(),
                                      headers=hdr) as r:
                        r.raise_for_status()
                if c.changes and apply:
                    log.append({"t": round(now, 2), "reason": c.reason, "chunk_tokens": c.chunk_tokens,
                                "step_budget_s": c.step_budget_s, "hand_back_s": c.hand_back_s,
                                "decode_step_s": inp.decode_step_s,
                                "velocity": {"prefill": v.prefill, "network": v.network, "decode": v.decode},
                                "conversion_prefill_velocity": inp.prefill_tokens_per_s,
                                "pd_ratio": None if ratio is None else ratio.reason})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop_at.wait(), 0.25)
    finally:
        await scraper.aclose()


def converted_digest(samples: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the converted decoder gave while it was converted, from the loop's samples: the share of a prefill
    engine the policy measured (`converted_share`: the decoder's prompt tokens/s over the prefiller's, each from
    its own steps) and the two rates, as min / median / max over the samples taken while converted (None:
    never converted)."""
    conv = [s for s in samples if s.get("converted")]
    if not conv:
        return None

    def spread(vals: list[float]) -> list[float] | None:
        vals = sorted(v for v in vals if v is not None)
        return [round(vals[0], 3), round(vals[len(vals) // 2], 3), round(vals[-1], 3)] if vals else None

    return {"samples": len(conv), "span_s": round(conv[-1]["t"] - conv[0]["t"], 2),
            "converted_share": spread([s.get("converted_share") for s in conv]),
            "decoder_prefill_tokens_per_s": spread([(s.get("prefill_rate") or {}).get("decode") for s in conv]),
            "prefiller_prefill_tokens_per_s": spread([(s.get("prefill_rate") or {}).get("prefill") for s in conv])}
