"""Host copies (issue 18 item 5) on real engine processes: a released engine keeps its weights in host memory
within --host-cache-gib, reloads from them on bind (source.hostCopy) with the same answers and keeps them while
it serves, feeds a load plan as a host source while it stays released, and drops them on keepHostCopy=false; a
serving engine keeps its copy as a host copy when asked (POST host-copy) within its budget, or says why not;
bad input is named."""

from __future__ import annotations

import time

import httpx

from kascade_devcluster.ports import free_ports
from kascade_engine.weights.hostcopy import keepable
from kascade_planner.baselines import build_star
from kascade_planner.plan import Instance, ModelLayout

BIND = {"model": "tiny-llama", "modelService": "svc", "role": "colocated"}
BODY = {"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 6}


def _h(e) -> dict[str, str]:
    return {"Authorization": f"Bearer {e.token}"}


def _status(e) -> dict:
    return httpx.get(e.url + "/kascade/v1/status", headers=_h(e)).json()


def _wait(e, ok, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _status(e)
        if ok(st) or st.get("loadError"):
            return st
        time.sleep(0.05)
    raise AssertionError(f"condition never held: {st}")


def _serve_from_disk(e, ckpt) -> str:
    ok = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"path": str(ckpt)}}, headers=_h(e))
    assert ok.status_code == 200, ok.text
    _wait(e, lambda s: s["phase"] == "serving")
    r = httpx.post(e.url + "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_release_keeps_a_host_copy_and_bind_reloads_from_it(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    e = engine_starter(
        ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", "--host-cache-gib", "1"]
    )
    try:
        h = _h(e)
        want = _serve_from_disk(e, tiny_ckpt)
        assert _status(e)["hostCopyBytes"] == 0  # serving: its copy is a GPU-side source, not a host copy
        httpx.post(e.url + "/kascade/v1/drain", headers=h)
        st = httpx.post(e.url + "/kascade/v1/release", headers=h).json()
        assert st["phase"] == "released" and not any(st["blocks"].values())
        assert st["hostCopyBytes"] == tiny_blocks.total_bytes
        assert httpx.post(e.url + "/v1/completions", json=BODY).status_code == 503  # released: not serving
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).json() == tiny_blocks.manifest()
        bad = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": "yes"}}, headers=h)
        assert bad.status_code == 400 and "source.hostCopy" in bad.json()["error"]["message"]
        bad = httpx.post(
            e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": True, "path": "/x"}}, headers=h
        )
        assert bad.status_code == 400 and "exactly one" in bad.json()["error"]["message"]
        ok = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": True}}, headers=h)
        assert ok.status_code == 200, ok.text
        st = _wait(e, lambda s: s["phase"] == "serving")
        # serving from its copy, it still keeps it (never zero while the service exists): the same buffers
        assert st["ready"] and st["hostCopyBytes"] == tiny_blocks.total_bytes and st["loadError"] is None
        got = httpx.post(e.url + "/v1/completions", json=BODY).json()["choices"][0]["text"]
        assert got == want
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).json() == tiny_blocks.manifest()
        # released again, then told to drop it: no copy, and bind from it is refused naming the field
        httpx.post(e.url + "/kascade/v1/drain", headers=h)
        assert httpx.post(e.url + "/kascade/v1/release", headers=h).json()["hostCopyBytes"] == tiny_blocks.total_bytes
        bad = httpx.post(e.url + "/kascade/v1/release", json={"keepHostCopy": 1}, headers=h)
        assert bad.status_code == 400 and "keepHostCopy" in bad.json()["error"]["message"]
        st = httpx.post(e.url + "/kascade/v1/release", json={"keepHostCopy": False}, headers=h).json()
        assert st["hostCopyBytes"] == 0 and st["phase"] == "released"
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).status_code == 404
        refused = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": True}}, headers=h)
        assert refused.status_code == 409 and "source.hostCopy" in refused.json()["error"]["message"]
        assert _status(e)["modelService"] is None  # a refused bind binds nothing
    finally:
        e.stop()


def test_without_a_budget_release_drops_the_weights(tiny_ckpt, engine_starter) -> None:
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])  # budget 0
    try:
        _serve_from_disk(e, tiny_ckpt)
        httpx.post(e.url + "/kascade/v1/drain", headers=_h(e))
        assert httpx.post(e.url + "/kascade/v1/release", json={"keepHostCopy": True}, headers=_h(e)).json()[
            "hostCopyBytes"] == 0
    finally:
        e.stop()


def test_a_model_over_the_budget_is_not_kept(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    """The budget bounds the copy: a model one KiB over --host-cache-gib is dropped at release, so bind from it
    is refused (and the operator records no host copy: it reads hostCopyBytes 0)."""
    budget_gib = (tiny_blocks.total_bytes - 1024) / 2**30
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty",
                        "--host-cache-gib", repr(budget_gib)])
    try:
        _serve_from_disk(e, tiny_ckpt)
        httpx.post(e.url + "/kascade/v1/drain", headers=_h(e))
        st = httpx.post(e.url + "/kascade/v1/release", headers=_h(e)).json()
        assert st["phase"] == "released" and st["hostCopyBytes"] == 0
        refused = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": True}}, headers=_h(e))
        assert refused.status_code == 409 and "source.hostCopy" in refused.json()["error"]["message"]
    finally:
        e.stop()


def test_a_released_host_copy_feeds_a_plan_and_stays_released(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    src = engine_starter(
        ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", "--host-cache-gib", "1"]
    )
    dst = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    try:
        want = _serve_from_disk(src, tiny_ckpt)
        httpx.post(src.url + "/kascade/v1/drain", headers=_h(src))
        assert httpx.post(src.url + "/kascade/v1/release", headers=_h(src)).json()["hostCopyBytes"] > 0
        layout = ModelLayout("tiny-llama", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
        plan = build_star(layout, [Instance("a", "n0", kind="host")], [Instance("b", "n1")]).to_dict()
        pa, pb = free_ports(2)
        doc = {"plan": plan, "peers": {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}, "planToken": "pt"}
        manifest = httpx.get(src.url + "/kascade/v1/manifest", headers=_h(src)).json()
        ok = httpx.post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "b", "manifest": manifest},
                        headers=_h(dst))
        assert ok.status_code == 200, ok.text
        ok = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "a"}, headers=_h(src))
        assert ok.status_code == 200, ok.text
        assert ok.json()["phase"] == "released"  # a host source: not loading, not serving
        st = _wait(dst, lambda s: s["ready"])
        assert st["bytesReceived"] == tiny_blocks.total_bytes
        s = _status(src)
        assert s["phase"] == "released" and s["hostCopyBytes"] == tiny_blocks.total_bytes
        assert httpx.post(src.url + "/v1/completions", json=BODY).status_code == 503
        assert httpx.post(dst.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] == want
    finally:
        src.stop()
        dst.stop()


def test_a_serving_engine_keeps_a_host_copy_when_asked(tiny_ckpt, tiny_blocks, engine_starter) -> None:
    """POST host-copy on a serving engine: it keeps its copy within the budget and serves on; asking again is a
    no-op; its release keeps that one copy (not a second); an engine without a budget answers 0 and why."""
    e = engine_starter(
        ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", "--host-cache-gib", "1"]
    )
    nob = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])  # budget 0
    try:
        h = _h(e)
        released = httpx.post(e.url + "/kascade/v1/host-copy", json={"keep": True}, headers=h).json()
        assert released["hostCopyBytes"] == 0 and "no complete copy" in released["reason"]  # empty: nothing to keep
        want = _serve_from_disk(e, tiny_ckpt)
        assert _status(e)["hostCopyBytes"] == 0  # from the source: no host copy until asked
        bad = httpx.post(e.url + "/kascade/v1/host-copy", json={"keep": "yes"}, headers=h)
        assert bad.status_code == 400 and "keep" in bad.json()["error"]["message"]
        for _ in range(2):  # idempotent
            ans = httpx.post(e.url + "/kascade/v1/host-copy", json={"keep": True}, headers=h)
            assert ans.status_code == 200 and ans.json() == {"hostCopyBytes": tiny_blocks.total_bytes}
        st = _status(e)
        assert st["phase"] == "serving" and st["hostCopyBytes"] == tiny_blocks.total_bytes
        assert httpx.post(e.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] == want
        httpx.post(e.url + "/kascade/v1/drain", headers=h)
        assert httpx.post(e.url + "/kascade/v1/release", headers=h).json()["hostCopyBytes"] == tiny_blocks.total_bytes
        ok = httpx.post(e.url + "/kascade/v1/bind", json={**BIND, "source": {"hostCopy": True}}, headers=h)
        assert ok.status_code == 200, ok.text
        assert _wait(e, lambda s: s["ready"])["hostCopyBytes"] == tiny_blocks.total_bytes
        dropped = httpx.post(e.url + "/kascade/v1/host-copy", json={"keep": False}, headers=h).json()
        assert dropped == {"hostCopyBytes": 0} and _status(e)["phase"] == "serving"
        assert httpx.post(e.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] == want

        _serve_from_disk(nob, tiny_ckpt)
        no = httpx.post(nob.url + "/kascade/v1/host-copy", json={}, headers=_h(nob)).json()
        assert no["hostCopyBytes"] == 0 and "--host-cache-gib" in no["reason"]
        assert _status(nob)["hostCopyBytes"] == 0
    finally:
        e.stop()
        nob.stop()


def test_keepable_holds_a_copy_within_the_budget_and_says_why_not(tiny_blocks) -> None:
    n = tiny_blocks.total_bytes
    assert keepable(tiny_blocks, n, "m") == (tiny_blocks, None)  # the blockset itself: no second copy
    kept, why = keepable(tiny_blocks, n - 1, "m")
    assert kept is None and why is not None and "exceed the --host-cache-gib budget" in why
    assert keepable(tiny_blocks, 0, "m") == (None, "no --host-cache-gib budget (0: never keeps one)")
    assert keepable(None, n, "m") == (None, "holds no complete copy of m to keep")
