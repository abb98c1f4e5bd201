"""HTTPS on the engine's HTTP port (issue 15), on real processes: an engine started with TLS files refuses
plain HTTP and answers HTTPS verified by the installation's CA (names unchecked, no client certificate asked:
the control API keeps its bearer token); the operator's EngineClient and Scraper with the CA bind, load and
scrape it; the router with --engine-ca routes a streamed completion to it; a certificate from another CA is
refused by each of them."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

BODY = {"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 6}


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from kascade_devcluster.peercerts import make_peer_certs

    return make_peer_certs(tmp_path_factory.mktemp("pki"))


def _tls_args(pki: dict[str, Path]) -> list[str]:
    return ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), "--tls-ca", str(pki["ca"])]


@pytest.fixture(scope="module")
def serving(pki: dict[str, Path], tiny_ckpt: Path, engine_starter: Any) -> Iterator[Any]:
    """An engine serving the tiny model with TLS files."""
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", *_tls_args(pki)])
    yield e
    e.stop()


def test_tls_engine_refuses_plain_http_and_answers_https_with_the_ca(serving: Any, pki: dict[str, Path]) -> None:
    plain = f"http://127.0.0.1:{serving.http}"
    for path in ("/healthz", "/metrics", "/kascade/v1/status"):
        with pytest.raises(httpx.TransportError):
            httpx.get(plain + path, headers={"Authorization": f"Bearer {serving.token}"}, timeout=10)
    assert serving.url.startswith("https://")
    ok = httpx.get(serving.url + "/healthz", verify=serving.verify, timeout=10)  # no client certificate
    assert ok.status_code == 200
    # the control API still authenticates by bearer token
    assert httpx.get(serving.url + "/kascade/v1/status", verify=serving.verify, timeout=10).status_code == 401
    st = httpx.get(serving.url + "/kascade/v1/status", verify=serving.verify, timeout=10,
                   headers={"Authorization": f"Bearer {serving.token}"})
    assert st.status_code == 200 and st.json()["phase"] == "serving", st.text
    r = httpx.post(serving.url + "/v1/completions", json=BODY, verify=serving.verify, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
    assert "kascade_generation_tokens_total" in httpx.get(serving.url + "/metrics", verify=serving.verify).text
    # a client trusting another CA refuses the engine's certificate
    rogue = type(serving)(serving.proc, serving.http, serving.act, serving.token, pki["rogue_ca"])
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(rogue.url + "/healthz", verify=rogue.verify, timeout=10)


async def test_engine_client_and_scraper_with_the_ca_bind_load_and_scrape_a_tls_engine(
        pki: dict[str, Path], tiny_ckpt: Path, tiny_blocks: Any, engine_starter: Any) -> None:
    from kascade_operator.engine_client import EngineClient, EngineError
    from kascade_operator.metrics import Scraper
    from kascade_operator.settings import OperatorSettings
    from kascade_planner.engine_tls import engine_tls_context

    s = OperatorSettings(engine_token="test-token", engine_ca_file=str(pki["ca"]))
    tls = engine_tls_context(s.engine_ca_file)
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", *_tls_args(pki)])
    endpoint = f"127.0.0.1:{e.http}"
    client, scraper = EngineClient(s.engine_token or "", 30, tls=tls), Scraper(10, tls=tls)
    plain, foreign = EngineClient(e.token, 10), EngineClient(e.token, 10, tls=engine_tls_context(str(pki["rogue_ca"])))
    try:
        with pytest.raises(EngineError) as err:
            await plain.status(endpoint)  # http:// to an HTTPS port
        assert err.value.status is None
        with pytest.raises(EngineError, match="CERTIFICATE_VERIFY_FAILED"):
            await foreign.status(endpoint)
        st = await client.bind(endpoint, "tiny-llama", "svc", "colocated", source_path=str(tiny_ckpt))
        assert st["modelService"] == "svc", st
        deadline = time.monotonic() + 90
        while (st := await client.status(endpoint))["phase"] != "serving" and not st["loadError"]:
            assert time.monotonic() < deadline, st
            await asyncio.sleep(0.1)
        assert st["ready"] and st["bytesReceived"] == tiny_blocks.total_bytes, st
        assert await client.manifest(endpoint) == tiny_blocks.manifest()
        async with httpx.AsyncClient(verify=tls) as h:
            r = await h.post(e.url + "/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6, r.text
        loads = await scraper.collect({"pod-a": endpoint})
        assert [x.instance for x in loads] == ["pod-a"], loads
    finally:
        for c in (client, plain, foreign):
            await c.aclose()
        await scraper.aclose()
        e.stop()


def test_operator_refuses_an_engine_ca_that_does_not_load_at_startup(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a certificate")
    env = {**os.environ, "KASCADE_OPERATOR_ENGINE_TOKEN": "t"}
    for bad in (tmp_path / "missing.pem", tmp_path / "junk.pem"):
        r = subprocess.run(
            [sys.executable, "-m", "kascade_cli.main", "operator", "run"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**env, "KASCADE_OPERATOR_ENGINE_CA_FILE": str(bad)},
        )
        assert r.returncode == 2 and "KASCADE_OPERATOR_ENGINE_CA_FILE" in r.stderr and bad.name in r.stderr, r.stderr


def _router(args: list[str]) -> tuple[subprocess.Popen[str], int]:
    cmd = [sys.executable, "-m", "kascade_cli.main", "router", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if m := re.match(r"KASCADE_ROUTER_READY http=(\d+)", line):
            return proc, int(m.group(1))
    raise AssertionError(f"router exited {proc.wait()}: {''.join(seen)[-2000:]}")


def _stream(port: int) -> tuple[int, list[str]]:
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**BODY, "stream": True},
                      timeout=60) as r:
        return r.status_code, [ln for ln in r.iter_lines() if ln.startswith("data: ")]


def test_router_with_engine_ca_streams_from_a_tls_engine(serving: Any, pki: dict[str, Path]) -> None:
    backend = f"tiny-llama=127.0.0.1:{serving.http}"
    want = httpx.post(serving.url + "/v1/completions", json=BODY, verify=serving.verify, timeout=60).json()
    proc, port = _router(["--backend", backend, "--engine-ca", str(pki["ca"]), "--attempts", "1"])
    try:
        status, events = _stream(port)
        assert status == 200 and events[-1] == "data: [DONE]" and len(events) >= 3, events
        text = "".join(json.loads(ev[6:])["choices"][0]["text"] for ev in events[:-1])
        assert text == want["choices"][0]["text"]  # greedy: the same tokens as asked directly
    finally:
        proc.terminate()
        proc.wait(10)
    # without the CA (plain HTTP to an HTTPS port) or with another CA the engine is never reached
    for extra in ([], ["--engine-ca", str(pki["rogue_ca"])]):
        proc, port = _router(["--backend", backend, "--attempts", "1", "--hold-timeout", "0", *extra])
        try:
            status, _ = _stream(port)
            assert status >= 500, (extra, status)
        finally:
            proc.terminate()
            proc.wait(10)


def test_router_refuses_an_engine_ca_that_does_not_load(tmp_path: Path) -> None:
    (tmp_path / "junk.pem").write_text("not a certificate")
    r = subprocess.run([sys.executable, "-m", "kascade_cli.main", "router", "--backend", "m=127.0.0.1:9",
                        "--engine-ca", str(tmp_path / "junk.pem")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--engine-ca" in r.stderr and "junk.pem" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_prometheus_scrapes_a_tls_engine_with_the_charts_podmonitor_tls_config(
        serving: Any, pki: dict[str, Path], tmp_path: Path) -> None:
    """A real Prometheus, configured from the chart's rendered PodMonitor endpoint (scheme https, CA from the
    Secret): without dataPlaneTls.serverName (insecureSkipVerify) the engine is up and its series arrive;
    with a serverName the engine's certificate does not carry, the scrape is refused (so a name is checked
    when one is given); plain http (the chart without TLS) gets nothing from a TLS engine."""
    import yaml

    from kascade_devcluster.binaries import MissingBinaries, bin_dir
    from kascade_devcluster.podmonitor import endpoint_tls
    from kascade_devcluster.prometheus import MissingPrometheus, PrometheusServer
    from kascade_devcluster.requirement import unavailable

    try:
        helm, prom = bin_dir() / "helm", PrometheusServer(tmp_path / "prom")
    except (MissingBinaries, MissingPrometheus) as e:
        unavailable(str(e))
    chart = Path(__file__).resolve().parents[2] / "charts" / "kascade"

    def endpoint(*values: str) -> dict[str, Any]:
        out = subprocess.run(
            [
                str(helm),
                "template",
                "rel",
                str(chart),
                "--set",
                "monitoring.podMonitor.enabled=true",
                "--api-versions",
                "monitoring.coreos.com/v1/PodMonitor",
                *[a for v in values for a in ("--set", v)],
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        pm = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor")
        return pm["spec"]["podMetricsEndpoints"][0]

    secrets = {("engine-tls", "ca.crt"): pki["ca"]}
    jobs = {"skip": endpoint("dataPlaneTls.secretName=engine-tls"),
            "named": endpoint("dataPlaneTls.secretName=engine-tls", "dataPlaneTls.serverName=not-in-the-cert"),
            "plain": endpoint()}
    prom.start([{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{serving.http}"]}],
                 **endpoint_tls(ep, secrets)} for job, ep in jobs.items()])
    try:
        deadline = time.monotonic() + 60
        while True:
            up = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
            if len(up) == 3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert up == {"skip": "1", "named": "0", "plain": "0"}, up
        assert prom.query('kascade_generation_tokens_total{job="skip"}'), "no engine series over https"
        errors = {t["labels"]["job"]: t["lastError"] for t in prom.api("targets")["activeTargets"]}
        assert "certificate" in errors["named"], errors
    finally:
        prom.stop()
