"""Matched tensor parallelism through the engines' ordinary `load-plan` (engine/kascade_engine/tp/planload.py):
a plan from a TP-2 source into a TP-2 target runs as two rank planes of *slices* — rank r of the source sends rank
r of the target exactly its slices over their own data ports (data port + r), each slice verified by its own digest,
no all-gather. Real engine processes (`kascade engine serve --tp 2`), real TCP data plane; greedy text equals the
TP-1 engine's. The loaded instance (holding only its ranks' slices, no whole block) then sources the next plan."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.ports import free_port_runs
from kascade_engine.weights.blocks import BlockSet
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, PlanError
from kascade_planner.topology import leaf_spine
from kascade_planner.tpgroup import instance_mode

from .conftest import start_engine

H = {"Authorization": "Bearer test-token"}
BODY = {"model": "tiny-llama", "prompt": "matched tensor parallel", "max_tokens": 8}


def _plan(blocks: BlockSet, src: str, dst: str, src_tp: int = 2, g: int = 2) -> dict[str, Any]:
    topo = leaf_spine(1, 2, 8)
    model = ModelLayout(blocks.model, blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    return make_plan(topo, model, [Instance(src, topo.nodes[0].name, src_tp)], [Instance(dst, topo.nodes[1].name, g)],
                     "chain", shard=False, predict=False).to_dict()


def _text(url: str) -> str:
    return str(httpx.post(url + "/v1/completions", json=BODY, timeout=120).json()["choices"][0]["text"])


def _wait_ready(url: str, timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    st: dict[str, Any] = {}
    while time.monotonic() < deadline:
        st = httpx.get(url + "/kascade/v1/status", headers=H).json()
        if st["ready"] or st["loadError"]:
            break
        time.sleep(0.2)
    return st


def _run_plan(src_url: str, dst_url: str, plan: dict[str, Any], ids: tuple[str, str]) -> dict[str, Any]:
    """Ask the source for the plan's manifest (`?parts=2`: every rank's slices), start the target, then the
    source, as the operator does; returns the target's status once ready (or failed)."""
    pa, pb = free_port_runs(2, 2)
    manifest = httpx.get(src_url + "/kascade/v1/manifest?parts=2", headers=H).json()
    doc = {"plan": plan, "peers": {ids[0]: f"127.0.0.1:{pa}", ids[1]: f"127.0.0.1:{pb}"}, "planToken": "pt"}
    ok = httpx.post(dst_url + "/kascade/v1/load-plan", json={**doc, "self": ids[1], "manifest": manifest}, headers=H)
    assert ok.status_code == 200, ok.text
    ok = httpx.post(src_url + "/kascade/v1/load-plan", json={**doc, "self": ids[0]}, headers=H)
    assert ok.status_code == 200, ok.text
    st = _wait_ready(dst_url)
    st["_manifest"] = manifest
    return st


def _slice_bytes(manifest: dict[str, Any], r: int) -> int:
    return sum(int(e["bytes"]) for k, e in manifest.items() if k.endswith(f"@{r}/2"))


def test_tp2_to_tp2_moves_each_ranks_slices_and_the_copy_sources_the_next(tiny_ckpt: Path,
                                                                          tiny_blocks: BlockSet) -> None:
    common = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
              "--kv-tokens", "4096"]
    ref = start_engine(common)
    src = start_engine([*common, "--tp", "2"])
    dst = start_engine([*common, "--tp", "2", "--empty"])
    nxt = start_engine([*common, "--tp", "2", "--empty"])
    try:
        want = _text(ref.url)
        whole = httpx.get(src.url + "/kascade/v1/manifest", headers=H).json()
        # the source serves while its ranks send: its step messages and the plan's share one control channel
        served: list[str] = []
        busy = threading.Thread(target=lambda: served.extend(_text(src.url) for _ in range(3)))
        busy.start()
        st = _run_plan(src.url, dst.url, _plan(tiny_blocks, "s0", "t0"), ("s0", "t0"))
        busy.join(120)
        assert served == [want] * 3
        assert st["ready"] and st["loadError"] is None, st
        manifest = st["_manifest"]
        assert "layer.0@1/2" in manifest and not any("#" in k for k in manifest)  # slices, no parts
        for s in st["tpLoad"]:  # exactly this rank's slices crossed its own link, and nothing was gathered
            r = int(s["rank"])
            assert int(s["bytes"]) == _slice_bytes(manifest, r)
            assert s["gatherSeconds"] == 0
        assert sorted(int(s["rank"]) for s in st["tpLoad"]) == [0, 1]
        assert _text(dst.url) == want
        # the copy holds no whole block, only its ranks' slices: it answers the whole manifest it loaded by and
        # every rank's slices (asked of the ranks), identical to the source's; parts it cannot give
        assert httpx.get(dst.url + "/kascade/v1/manifest", headers=H).json() == whole
        assert httpx.get(dst.url + "/kascade/v1/manifest?parts=2", headers=H).json() == manifest
        bad = httpx.get(dst.url + "/kascade/v1/manifest?parts=4", headers=H)
        assert bad.status_code == 409 and "parts" in bad.text, bad.text
        # ...and is the source of the next matched plan: each of its ranks sends its own slices
        st2 = _run_plan(dst.url, nxt.url, _plan(tiny_blocks, "t0", "t1"), ("t0", "t1"))
        assert st2["ready"] and st2["loadError"] is None, st2
        assert [int(s["bytes"]) for s in sorted(st2["tpLoad"], key=lambda s: s["rank"])] == [
            _slice_bytes(manifest, 0), _slice_bytes(manifest, 1)]
        assert _text(nxt.url) == want
    finally:
        for e in (ref, src, dst, nxt):
            e.stop()


def test_the_share_kind_follows_the_plans_sources(tiny_blocks: BlockSet) -> None:
    """The share kind follows the plan alone: TP-g sources -> slices, TP-1 sources -> parts, any other width is
    refused naming `sources`."""
    assert instance_mode(_plan_obj(tiny_blocks, 2), 2) == "slices"
    assert instance_mode(_plan_obj(tiny_blocks, 1), 2) == "parts"
    with pytest.raises(PlanError, match=r"sources: .* of 2 GPUs"):
        instance_mode(_plan_obj(tiny_blocks, 2, g=4), 4)


def _plan_obj(blocks: BlockSet, src_tp: int, g: int = 2) -> Any:
    from kascade_planner.plan import Plan

    return Plan.from_dict(_plan(blocks, "s0", "t0", src_tp, g))
