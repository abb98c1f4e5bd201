"""A real engine's metrics give the operator the right output-length estimate (kascade_planner.outputlength):
requests served over HTTP, the engine's /metrics scraped before and after by the operator's own parser and rate
tracker; the window's arrivals and the finished requests' mean output match what the clients were served (an
aborted stream counts as an arrival, not toward the output length)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot


def _scrape(url: str) -> tuple[str, float]:
    return httpx.get(url + "/metrics").text, time.monotonic()


def test_engine_metrics_give_arrivals_and_mean_output_length(engine_a) -> None:
    r = RateTracker(window_s=0.0)
    text0, t0 = _scrape(engine_a.url)
    r.update("e", parse_engine_metrics(text0, t0))
    c = openai.OpenAI(base_url=engine_a.url + "/v1", api_key="unused", max_retries=0)
    served = [c.completions.create(model="tiny-llama", prompt="hello there", max_tokens=n).usage.completion_tokens
              for n in (3, 7, 12, 20)]
    body = {"model": "tiny-llama", "prompt": "go on and on", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", engine_a.url + "/v1/completions", json=body, timeout=30) as s:
        for i, _ in enumerate(s.iter_lines()):
            if i == 4:  # a few tokens in: the client goes away (an abort, its output cut short)
                break
    deadline = time.monotonic() + 5
    while 'finished_reason="abort"' not in httpx.get(engine_a.url + "/metrics").text and time.monotonic() < deadline:
        time.sleep(0.02)
    text, t1 = _scrape(engine_a.url)
    load = r.update("e", parse_engine_metrics(text, t1))
    assert load.output_length is not None
    assert load.output_length.window_requests == 4 and load.output_length.window_tokens == sum(served)
    assert load.output_length.mean == pytest.approx(sum(served) / 4)
    window = t1 - t0
    assert load.requests_per_s * window == pytest.approx(5)  # four finished + the aborted one arrived
    snap = snapshot([load], t1)
    assert snap.decode_demand.output_len == pytest.approx(sum(served) / 4)
    assert snap.decode_demand.projected_tokens_per_s == pytest.approx(5 / window * sum(served) / 4)
