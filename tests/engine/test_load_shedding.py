"""Engine load shedding (issue 38): beyond --max-waiting-tokens prompt tokens waiting for a first step,
a request is refused at once with 503 + Retry-After and counted in kascade_requests_shed_total, on a real
engine process; requests admitted before still complete. (Before: the queue was unbounded.)"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def shedding_engine(tiny_ckpt: Path, engine_starter: Any) -> Iterator[Any]:
    # one sequence per step and 40 ms per layer: a burst queues; 100 waiting prompt tokens at most
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", MODEL, "--max-prompt-tokens", "64",
                        "--kv-tokens", "4096", "--max-seqs", "1", "--emulate-layer-ms", "40",
                        "--max-waiting-tokens", "100"])
    yield e
    e.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_burst_beyond_the_waiting_bound_is_shed_with_503_and_retry_after(shedding_engine: Any) -> None:
    url = shedding_engine.url
    body = {"model": MODEL, "prompt": list(range(1, 41)), "max_tokens": 4}  # 40 prompt tokens each

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions", json=body) for _ in range(12)))

    before = _metric(url, "kascade_requests_shed_total")
    answers = asyncio.run(burst())
    shed = [r for r in answers if r.status_code == 503]
    ok = [r for r in answers if r.status_code == 200]
    assert len(shed) + len(ok) == len(answers), [r.status_code for r in answers]
    assert shed and len(ok) >= 3, [r.status_code for r in answers]  # the running one + ~2 waiting fit 100 tokens
    for r in shed:
        assert r.headers.get("retry-after") == "1"
        assert "--max-waiting-tokens" in r.json()["error"]["message"]
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == 4
    assert _metric(url, "kascade_requests_shed_total") - before == len(shed)
    again = httpx.post(url + "/v1/completions", json=body, timeout=60)  # the queue drained: admitted again
    assert again.status_code == 200, again.text


def test_connection_refusals_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """A flood of refused connections writes one warning per interval with the count, not one per
    connection (19,376 lines before)."""
    from kascade_engine.http import httpguard

    with caplog.at_level("WARNING", logger=httpguard.__name__):
        for i in range(500):
            httpguard._refused(("10.0.0.1", i), 1025, 1024)
    lines = [r for r in caplog.records if "refusing a connection" in r.getMessage()]
    assert len(lines) <= 1, len(lines)
