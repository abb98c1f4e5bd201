"""The engine's HTTP front against hostile or careless clients, on a real engine process: a seed that
torch cannot take leaves no ghost sequence; a big body is refused before it is read; slow headers and
idle sockets are closed (slowloris); a non-streaming client that leaves stops its generation; sampling
values below float32 resolution, lone surrogates and prompts past the context are 400s naming the field;
no schema is published without a token. Each failed on the engine before this."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def guarded_engine(tiny_ckpt: Path, engine_starter: Any) -> Iterator[Any]:
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", MODEL, "--max-prompt-tokens", "64",
                        "--kv-tokens", "4096", "--header-timeout", "1", "--max-connections", "48"])
    yield e
    e.stop()


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _busy(url: str) -> float:
    return _metric(url, "kascade_num_requests_running") + _metric(url, "kascade_num_requests_waiting")


def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


def test_a_seed_torch_cannot_take_is_a_400_and_leaves_no_ghost(guarded_engine: Any) -> None:
    url = guarded_engine.url
    for seed in (2**64, 2**70, -1):
        r = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    time.sleep(0.3)
    assert _busy(url) == 0  # nothing left in the scheduler (a ghost burned a core and blocked release)
    ok = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_big_body_is_refused_before_it_is_read(guarded_engine: Any) -> None:
    url = guarded_engine.url
    big = {"model": MODEL, "prompt": "x" * (16 << 20), "max_tokens": 1}
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", content=json.dumps(big), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert httpx.get(url + "/healthz", timeout=2).status_code == 200


def test_slow_headers_and_idle_sockets_are_closed(guarded_engine: Any) -> None:
    url, port = guarded_engine.url, guarded_engine.http
    socks = []
    for _ in range(40):  # slowloris: headers that never end, one byte at a time
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        for s in socks:
            with contextlib.suppress(OSError):
                s.sendall(b"X")
        time.sleep(0.2)
    closed = 0
    for s in socks:
        s.settimeout(2)
        try:
            closed += s.recv(1) == b""
        except OSError:
            closed += 1
        s.close()
    assert closed == len(socks), f"{len(socks) - closed} slow-header connections still open after 3 s"
    # a flood of idle sockets past --max-connections: the extra ones are closed at once
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(60)]
    try:
        time.sleep(0.3)
        shut = 0
        for s in idle:
            s.settimeout(0.05)
            try:
                shut += s.recv(1) == b""
            except TimeoutError:
                pass
            except OSError:
                shut += 1
        assert shut >= 60 - 48
    finally:
        for s in idle:
            s.close()
    time.sleep(1.5)  # the header timeout frees the rest
    assert httpx.get(url + "/healthz", timeout=2).status_code == 200


def test_a_non_streaming_client_that_leaves_stops_its_generation(guarded_engine: Any) -> None:
    url = guarded_engine.url
    aborts = _metric(url, 'kascade_request_success_total{finished_reason="abort",model_name="tiny-llama"}')
    body = json.dumps({"model": MODEL, "prompt": "go", "max_tokens": 500}).encode()  # context: 512
    s = socket.create_connection(("127.0.0.1", guarded_engine.http), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while _metric(url, "kascade_num_requests_running") == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _metric(url, "kascade_num_requests_running") == 1
    s.close()  # the client leaves long before 500 tokens
    deadline = time.monotonic() + 5
    while _busy(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _busy(url) == 0
    assert _metric(url, 'kascade_request_success_total{finished_reason="abort",model_name="tiny-llama"}') == aborts + 1


@pytest.mark.parametrize(("body", "param"), [
    ({"temperature": 1e-30}, "temperature"),
    ({"temperature": 0.5, "top_p": 1e-30}, "top_p"),
    ({"prompt": "\ud800 lone surrogate"}, "prompt"),
    ({"max_tokens": 4000, "prompt": "a long answer please"}, "max_tokens"),  # past the 256-token context
], ids=["temperature", "top_p", "surrogate", "context"])
def test_bad_sampling_text_and_context_are_400s_naming_the_field(guarded_engine: Any, body: dict[str, Any],
                                                                 param: str) -> None:
    doc = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}
    raw = json.dumps(doc)  # json.dumps writes the lone surrogate as the escape \ud800, as a client would
    r = httpx.post(guarded_engine.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_no_schema_without_a_token(guarded_engine: Any) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(guarded_engine.url + path, timeout=5).status_code == 404
