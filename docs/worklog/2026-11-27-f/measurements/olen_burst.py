"""Burst lag of measured output tokens/s vs arrivals x estimated output length, on a real SmolLM2-135M engine
(CPU, 2 threads). History: 4 sequential requests of max_tokens=32 (SmolLM stops at EOS after 10); then 16 concurrent ones;
the operator's parser + RateTracker read /metrics at 0.5 s and 1.0 s into the burst and after it."""

import asyncio
import json
import threading
import time
from typing import Any

import httpx

from kascade_devcluster.localengine import start_engine
from kascade_operator.metrics import RateTracker, parse_engine_metrics, snapshot


def main() -> None:
    e = start_engine(["--smollm", "--model-name", "smollm2-135m", "--threads", "2"])
    try:
        url = e.url
        c = httpx.Client(timeout=300)
        body = {"model": "smollm2-135m", "prompt": "Tell me a long story about a cat", "max_tokens": 32}
        for _ in range(4):
            c.post(url + "/v1/completions", json=body).raise_for_status()
        r = RateTracker()

        def scrape(label: str, t0: float) -> None:
            now = time.monotonic()
            load = r.update("e", parse_engine_metrics(c.get(url + "/metrics").text, now))
            dd = snapshot([load], now).decode_demand
            print(json.dumps({"at": label, "t_s": round(now - t0, 2),
                              "measured_output_tok_s": round(dd.measured_tokens_per_s, 1),
                              "requests_per_s": round(dd.requests_per_s, 2), "output_len_est": dd.output_len,
                              "decode_demand_tok_s": round(dd.tokens_per_s, 1), "reason": dd.reason}), flush=True)

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=300) as ac:
                return await asyncio.gather(*(ac.post(url + "/v1/completions", json=body) for _ in range(16)))

        scrape("before burst", time.monotonic())
        done: dict[str, Any] = {}
        th = threading.Thread(target=lambda: done.setdefault("r", asyncio.run(burst())))
        t0 = time.monotonic()
        th.start()
        time.sleep(0.5)
        scrape("0.5 s into the burst", t0)
        time.sleep(0.5)
        scrape("1.0 s into the burst", t0)
        th.join()
        scrape("burst finished", t0)
        print(json.dumps({"burst_s": round(time.monotonic() - t0, 2),
                          "completion_tokens": [x.json()["usage"]["completion_tokens"] for x in done["r"]][:3]}))
    finally:
        e.stop()


if __name__ == "__main__":
    main()
