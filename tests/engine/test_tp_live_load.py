"""A tensor-parallel target serves its resident prefix while it loads by plan (docs/tp.md, "Loading layer by layer"):
every rank receives its plane beside the step loop, rank 0 installs each block on every rank as soon as every rank
holds its verified share (tp/progressive.py), so a TP-2 engine paired live with its source serves requests split
before its load completes, as a TP-1 target does.

Real engine processes (`kascade engine serve --tp 2 --empty`, gloo), real TCP data plane. The model: a random Llama
of 6 layers at hidden 128 (4 MB), so that the source's egress cap (`--transfer-max-mbps`, its first MiB a burst)
leaves most layers in flight for tens of seconds while the first ones are resident."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.localengine import EngineProc
from kascade_devcluster.ports import free_port_runs
from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama

from .conftest import start_engine
from .test_tp_live import PROMPTS, _cooperate, _metric
from .test_tp_planes import _instance_plan

H = {"Authorization": "Bearer test-token"}
COMMON = ["--model-name", "tiny-llama", "--max-prompt-tokens", "128", "--kv-tokens", "4096", "--max-batch-tokens", "16"]


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("wide") / "tiny-llama", layers=6, hidden=128, vocab=512)


def _text(e: EngineProc, prompt: list[int]) -> str:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 10, "temperature": 0}
    r = httpx.post(e.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _texts(e: EngineProc) -> list[str]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda q: _text(e, q), PROMPTS))


def _status(e: EngineProc) -> dict[str, Any]:
    return dict(httpx.get(e.url + "/kascade/v1/status", headers=H, timeout=30).json())


def _wait(e: EngineProc, ok: Callable[[dict[str, Any]], bool], what: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = _status(e)
        assert not st["loadError"], st
        if ok(st):
            return st
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}: {st}")


def _prefix(st: dict[str, Any]) -> int:
    n = 0
    while st["blocks"].get(f"layer.{n}"):
        n += 1
    return n


def test_a_tp2_target_serves_split_with_its_source_while_it_loads(wide_ckpt: Path) -> None:
    blocks: BlockSet = pack_checkpoint(wide_ckpt, model="tiny-llama")
    L = 6
    # A: the source (TP-1, whole model), 0.5 Mbit/s after its first MiB: embed and a layer or two land at once, the
    # rest over ~45 s. B: TP-2, empty, its two ranks' planes on its data port + 0 and + 1.
    a = start_engine(["--checkpoint", str(wide_ckpt), *COMMON, "--transfer-max-mbps", "0.5"], timeout=300)
    b = start_engine(["--checkpoint", str(wide_ckpt), *COMMON, "--tp", "2", "--empty"], timeout=300)
    try:
        want = _texts(a)  # the TP-1 engine's greedy text
        assert len(set(want)) > 2  # a degenerate model would make the comparison meaningless
        sp, tp_ = free_port_runs(2, 2)
        doc = {"plan": _instance_plan(blocks, 2).to_dict(), "planToken": "live",
               "peers": {"s0": f"127.0.0.1:{sp}", "t0": f"127.0.0.1:{tp_}"}, "timeoutSeconds": 120}
        manifest = httpx.get(a.url + "/kascade/v1/manifest?parts=2", headers=H).json()
        r = httpx.post(b.url + "/kascade/v1/load-plan", json={**doc, "self": "t0", "manifest": manifest}, headers=H)
        assert r.status_code == 200 and r.json()["phase"] == "loading", r.text
        assert _cooperate(b, a).status_code == 200  # B pairs with its source, as the operator plans it
        r = httpx.post(a.url + "/kascade/v1/load-plan", json={**doc, "self": "s0"}, headers=H)
        assert r.status_code == 200, r.text
        st = _wait(b, lambda s: s["blocks"]["embed"] and s["blocks"]["layer.0"] and s["phase"] == "live",
                   "B's first layer on both ranks")
        assert not st["ready"] and _prefix(st) < L, st
        split = _metric(b, "kascade_live_split_requests_total")
        got = _texts(b)  # B's requests: its resident layers on its two ranks, the rest on A
        after = _status(b)
        assert got == want
        assert _metric(b, "kascade_live_split_requests_total") == split + len(PROMPTS)
        assert not after["ready"] and _prefix(after) < L, ("the load completed before the requests did: the test "
                                                            f"proves nothing; slow the source down ({after})")
        done = _wait(b, lambda s: bool(s["ready"]), "B's load to complete", timeout=300)
        assert sorted(int(s["rank"]) for s in done["tpLoad"]) == [0, 1]
        assert _texts(b) == want  # and whole, alone
    finally:
        for e in (a, b):
            e.stop()


def test_a_plan_failing_mid_load_fails_the_load_keeps_the_installed_layers_and_the_next_plan_loads(
        wide_ckpt: Path) -> None:
    """The source dies after B installed its first layers on both ranks: the load fails on every rank (loadError
    names the planes), the instance stays up with both ranks and the layers it had installed (as a TP-1 target keeps
    its verified blocks), every rank stops receiving (their data ports are free), and after a release the next plan
    over the same ports loads B whole, serving the TP-1 text."""
    import os
    import signal

    blocks: BlockSet = pack_checkpoint(wide_ckpt, model="tiny-llama")
    a = start_engine(["--checkpoint", str(wide_ckpt), *COMMON, "--transfer-max-mbps", "0.5"], timeout=300)
    b = start_engine(["--checkpoint", str(wide_ckpt), *COMMON, "--tp", "2", "--empty"], timeout=300)
    a2: EngineProc | None = None
    try:
        want = _texts(a)
        sp, tp_ = free_port_runs(2, 2)
        doc = {"plan": _instance_plan(blocks, 2).to_dict(), "planToken": "dies",
               "peers": {"s0": f"127.0.0.1:{sp}", "t0": f"127.0.0.1:{tp_}"}, "timeoutSeconds": 15}
        manifest = httpx.get(a.url + "/kascade/v1/manifest?parts=2", headers=H).json()
        assert httpx.post(b.url + "/kascade/v1/load-plan", json={**doc, "self": "t0", "manifest": manifest},
                          headers=H).status_code == 200
        assert httpx.post(a.url + "/kascade/v1/load-plan", json={**doc, "self": "s0"}, headers=H).status_code == 200
        _wait(b, lambda s: s["blocks"]["layer.0"], "B's first layer on both ranks")
        os.kill(a.proc.pid, signal.SIGKILL)
        a.proc.wait(30)
        deadline = time.monotonic() + 120
        while not (st := _status(b))["loadError"]:
            assert time.monotonic() < deadline, st
            time.sleep(0.2)
        assert "rank" in st["loadError"] and not st["ready"], st
        assert st["blocks"]["embed"] and st["blocks"]["layer.0"] and _prefix(st) < 6, st  # kept, as at tp 1
        assert b.proc.poll() is None and len(Path(f"/proc/{b.proc.pid}/task/{b.proc.pid}/children").read_text()
                                              .split()) == 1  # the instance, both ranks, is up
        assert httpx.post(b.url + "/kascade/v1/release", headers=H, json={}).status_code == 200
        a2 = start_engine(["--checkpoint", str(wide_ckpt), *COMMON], timeout=300)
        doc = {**doc, "planToken": "next", "timeoutSeconds": 60}
        assert httpx.post(b.url + "/kascade/v1/load-plan", json={**doc, "self": "t0", "manifest": manifest},
                          headers=H).status_code == 200
        assert httpx.post(a2.url + "/kascade/v1/load-plan", json={**doc, "self": "s0"}, headers=H).status_code == 200
        done = _wait(b, lambda s: bool(s["ready"]), "B's next load", timeout=180)
        assert sorted(int(s["rank"]) for s in done["tpLoad"]) == [0, 1]
        assert _texts(b) == want
    finally:
        for e in (a, b, a2):
            if e is not None:
                e.stop()
