"""load-plan end to end: a serving engine (source) streams its blocks to an empty engine process over
the data plane; the target turns ready and answers exactly like the source."""

from __future__ import annotations

import time

import httpx

from kascade_devcluster.ports import free_ports
from kascade_planner.baselines import build_star
from kascade_planner.plan import Instance, ModelLayout


def _h(e) -> dict[str, str]:
    return {"Authorization": f"Bearer {e.token}"}


def test_empty_engine_loads_by_plan_and_matches(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    src = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama"])
    dst = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    try:
        body = {"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 6}
        r = httpx.post(dst.url + "/v1/completions", json=body)
        assert r.status_code == 503 and "engine is empty" in r.json()["error"]["message"]
        assert httpx.get(dst.url + "/kascade/v1/status", headers=_h(dst)).json()["phase"] == "empty"
        layout = ModelLayout("tiny-llama", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
        plan = build_star(layout, [Instance("a", "n0")], [Instance("b", "n1")]).to_dict()
        pa, pb = free_ports(2)
        doc = {"plan": plan, "peers": {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}, "planToken": "pt"}
        bad = httpx.post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "b"}, headers=_h(dst))
        assert bad.status_code == 400 and "manifest" in bad.json()["error"]["message"]
        bad = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "zz"}, headers=_h(src))
        assert bad.status_code == 400 and "'zz'" in bad.json()["error"]["message"]
        ok = httpx.post(
            dst.url + "/kascade/v1/load-plan",
            json={**doc, "self": "b", "manifest": tiny_blocks.manifest()},
            headers=_h(dst),
        )
        assert ok.status_code == 200, ok.text
        assert ok.json()["phase"] == "loading"
        # asked again for the plan it runs (the source has not sent yet): a no-op; another plan: refused, said so
        again = httpx.post(dst.url + "/kascade/v1/load-plan",
                           json={**doc, "self": "b", "manifest": tiny_blocks.manifest()}, headers=_h(dst))
        assert again.status_code == 200 and again.json()["phase"] == "loading", again.text
        other = httpx.post(dst.url + "/kascade/v1/load-plan",
                           json={**doc, "self": "b", "planToken": "other", "manifest": tiny_blocks.manifest()},
                           headers=_h(dst))
        assert other.status_code == 409 and "another plan" in other.json()["error"]["message"], other.text
        ok = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "a"}, headers=_h(src))
        assert ok.status_code == 200, ok.text
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            st = httpx.get(dst.url + "/kascade/v1/status", headers=_h(dst)).json()
            if st["ready"]:
                break
            time.sleep(0.2)
        assert st["ready"] and all(st["blocks"].values()), st
        assert st["bytesReceived"] == tiny_blocks.total_bytes
        assert httpx.get(dst.url + "/readyz").status_code == 200
        m = httpx.get(dst.url + "/metrics").text
        assert f"kascade_transfer_bytes {float(tiny_blocks.total_bytes)}" in m
        assert "kascade_transfer_bandwidth_bytes_per_second 0.0" not in m
        want = httpx.post(src.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        got = httpx.post(dst.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        assert got == want
        # what it received is a complete copy: it can be the source of the next plan
        assert httpx.get(dst.url + "/kascade/v1/manifest", headers=_h(dst)).json() == tiny_blocks.manifest()
    finally:
        src.stop()
        dst.stop()


def _wait_phase(e, phase: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = httpx.get(e.url + "/kascade/v1/status", headers=_h(e)).json()
        if st["phase"] == phase or st.get("loadError"):
            return st
        time.sleep(0.1)
    raise AssertionError(f"engine never reached phase {phase}: {st}")


def test_bind_with_source_loads_first_copy_and_release_drops_it(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    try:
        h = _h(e)
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).status_code == 404
        bind = {"model": "tiny-llama", "modelService": "svc", "role": "colocated"}
        bad = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "source": {"path": "/nonexistent/ckpt"}}, headers=h)
        assert bad.status_code == 400 and "source.path" in bad.json()["error"]["message"]
        bad = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "source": {"path": ""}}, headers=h)
        assert bad.status_code == 400 and "source.path" in bad.json()["error"]["message"]
        ok = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "source": {"path": str(tiny_ckpt)}}, headers=h)
        assert ok.status_code == 200 and ok.json()["modelService"] == "svc"
        st = _wait_phase(e, "serving")
        assert st["ready"] and st["loadError"] is None and st["bytesReceived"] == tiny_blocks.total_bytes
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).json() == tiny_blocks.manifest()
        r = httpx.post(e.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        other = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "modelService": "other"}, headers=h)
        assert other.status_code == 409 and "bound to 'svc'" in other.json()["error"]["message"]
        st = httpx.post(e.url + "/kascade/v1/release", headers=h).json()
        assert st["phase"] == "released" and st["modelService"] is None and not any(st["blocks"].values())
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).status_code == 404
        r = httpx.post(e.url + "/v1/completions", json={"model": "tiny-llama", "prompt": [1, 2], "max_tokens": 3})
        assert r.status_code == 503
    finally:
        e.stop()
