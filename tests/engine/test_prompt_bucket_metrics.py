"""A real engine counts the prompt tokens arriving per prompt-length bucket (kascade_prompt_tokens_arrived_total
{bucket}, the prefill velocity's buckets: kascade_engine.batch.velocity.PROMPT_BUCKETS): requests of known prompt
lengths served over HTTP, the engine's /metrics scraped before and after by the operator's own parser and rate
tracker; the window's per-bucket prompt tokens are the prompts' lengths summed by bucket, every bucket is exposed
from 0 (a series that appears late loses its first increase in a PromQL rate()), and the snapshot carries the
demand its prefill velocity is weighted by."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot

MODEL = "tiny-llama"
LENGTHS = (10, 100, 129, 300, 510)  # "128": 10 + 100; "512": 129 + 300 + 510 (the tiny model's context: 512)


@pytest.fixture(scope="module")
def engine_long(tiny_ckpt: Path, engine_starter):
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", MODEL, "--max-prompt-tokens", "511",
                        "--kv-tokens", "4096"])
    yield e
    e.stop()


def _scrape(url: str) -> tuple[str, float]:
    return httpx.get(url + "/metrics").text, time.monotonic()


def test_engine_counts_prompt_tokens_by_length_bucket(engine_long) -> None:
    text0, t0 = _scrape(engine_long.url)
    for b in ("128", "512", "2048", "inf"):  # exposed before any request
        assert f'kascade_prompt_tokens_arrived_total{{bucket="{b}",model_name="{MODEL}"}} 0.0' in text0
    r = RateTracker(window_s=0.0)
    r.update("e", parse_engine_metrics(text0, t0))
    for i, n in enumerate(LENGTHS):
        body = {"model": MODEL, "prompt": [(7 * i + j) % 500 + 1 for j in range(n)], "max_tokens": 1}
        got = httpx.post(engine_long.url + "/v1/completions", json=body, timeout=60)
        assert got.status_code == 200, got.text
        assert got.json()["usage"]["prompt_tokens"] == n
    text1, t1 = _scrape(engine_long.url)
    load = r.update("e", parse_engine_metrics(text1, t1))
    window = t1 - t0
    tokens = {b: x * window for b, x in load.prompt_tokens_per_s_by_bucket}
    assert tokens == pytest.approx({"128": 110.0, "2048": 0.0, "512": 939.0, "inf": 0.0})
    assert load.input_tokens_per_s * window == pytest.approx(sum(LENGTHS))  # the buckets split the same tokens
    snap = snapshot([load], t1)
    assert snap.prompt_tokens_per_s_by_bucket == load.prompt_tokens_per_s_by_bucket
