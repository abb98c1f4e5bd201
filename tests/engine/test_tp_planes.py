"""Loading a tensor-parallel instance by plan (engine/kascade_engine/tp/planes.py): every rank is its own
data-plane participant on its own port and receives only its share of every block. Parts (TP-1 source -> TP-2):
each rank's link carries half the bytes, the ranks all-gather, verify and keep their slices; slices (matched TP):
each rank receives exactly its slices. Real rank processes (gloo), real TCP data plane; greedy text equals tp 1."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from kascade_devcluster.ports import free_port_runs, free_ports
from kascade_engine.net.relay import TransferNode
from kascade_engine.net.transport_tcp import TcpTransport
from kascade_engine.tp.planes import Plane, PlaneSpec, build_planes, share_blocks
from kascade_engine.tp.shard import TPLayout
from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import leaf_spine
from kascade_planner.tpgroup import Mode, part_range

from .test_tp import PROMPTS, TOKENS, _run_args, _tp1


def _instance_plan(blocks: BlockSet, g: int, src_tp: int = 1) -> Plan:
    topo = leaf_spine(1, 2, 8)
    model = ModelLayout(blocks.model, blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    return make_plan(topo, model, [Instance("s0", topo.nodes[0].name, src_tp)],
                     [Instance("t0", topo.nodes[1].name, g)], "chain", shard=False, predict=False)


def _planes(blocks: BlockSet, g: int, mode: Mode, src_tp: int = 1) -> list[Plane]:
    plan = _instance_plan(blocks, g, src_tp)
    ids = [f"{i.id}@{r}" for r in range(g) for i in (*plan.sources, *plan.targets)]
    ports = dict(zip(ids, free_ports(len(ids)), strict=True))
    token = secrets.token_hex(8)

    def address(participant: str, rank: int) -> tuple[str, int]:
        return "127.0.0.1", ports[f"{participant.split('.r')[0]}@{rank}"]

    return build_planes(plan, blocks, g, mode, token, address, chunk_bytes=16384, timeout_s=20.0)


class Sources:
    """The plan's sources, one TransferNode per plane, on an asyncio loop in a thread of the test."""

    def __init__(self, planes: list[Plane]) -> None:
        self.planes = planes
        self.summaries: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.skip_wait = False
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _targets_listening(self, timeout: float = 120.0) -> None:
        """Push only once every rank listens (a rank process imports torch first; a refused connect drops it)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        for p in self.planes:
            host, port = p.spec.peers[p.spec.plan.targets[0].id]
            while True:
                try:
                    _, w = await asyncio.open_connection(host, port)
                    w.close()
                    break
                except OSError:
                    if loop.time() > deadline or self.skip_wait:
                        return
                    await asyncio.sleep(0.1)

    async def _run(self) -> None:
        try:
            nodes = [TransferNode(p.spec, p.spec.plan.sources[0].id, TcpTransport(), p.source_blocks)
                     for p in self.planes]
            for n in nodes:
                await n.start()
            self.ready.set()
            await self._targets_listening()
            try:
                self.summaries = list(await asyncio.gather(*(n.run() for n in nodes)))
            finally:
                for n in nodes:
                    await n.close()
        except BaseException as e:  # reported by the test
            self.error = e
            self.ready.set()


def _write_planes(planes: list[Plane], blocks: BlockSet, mode: Mode, d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for p in planes:
        me = p.spec.plan.targets[0].id
        (d / f"rank{p.rank}.json").write_text(json.dumps(PlaneSpec(p.spec, me, mode, blocks.manifest()).to_dict()))
    return d


def _load_by_plan(ckpt: Path, tmp: Path, mode: Mode, g: int = 2) -> dict[str, Any]:
    blocks = pack_checkpoint(ckpt, model="tiny-llama")
    planes = _planes(blocks, g, mode, src_tp=1 if mode == "parts" else g)
    d = _write_planes(planes, blocks, mode, tmp / "planes")
    src = Sources(planes)
    src.thread.start()
    assert src.ready.wait(30) and src.error is None, src.error
    r = subprocess.run([*_run_args(ckpt, g, PROMPTS, TOKENS), "--plane-dir", str(d)], capture_output=True,
                       text=True, timeout=300)
    src.thread.join(30)
    assert r.returncode == 0, r.stderr[-3000:]
    assert src.error is None, src.error
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    out["_planes"] = planes
    out["_blocks"] = blocks
    return out


def test_parts_into_tp2_move_half_the_bytes_per_rank_and_serve_tp1_text(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = _load_by_plan(tiny_ckpt, tmp_path, "parts")
    blocks: BlockSet = out["_blocks"]
    assert out["tokens"] == _tp1(tiny_ckpt, PROMPTS, TOKENS)
    stats = sorted(out["load"], key=lambda s: s["rank"])
    assert [int(s["rank"]) for s in stats] == [0, 1]
    for r, s in enumerate(stats):  # exactly this rank's parts crossed its link, nothing more
        want = sum(hi - lo for b in blocks.blocks.values() for lo, hi in [part_range(b.nbytes, r, 2)])
        assert int(s["bytes"]) == want
        assert abs(want - blocks.total_bytes / 2) <= len(blocks.blocks)
        assert s["gatherSeconds"] > 0


def test_matched_tp_slices_need_no_gather_and_serve_tp1_text(tiny_ckpt: Path, tmp_path: Path) -> None:
    out = _load_by_plan(tiny_ckpt, tmp_path, "slices")
    blocks: BlockSet = out["_blocks"]
    assert out["tokens"] == _tp1(tiny_ckpt, PROMPTS, TOKENS)
    lay = TPLayout.of(blocks.config, 2)
    for s in out["load"]:
        r = int(s["rank"])
        assert int(s["bytes"]) == share_blocks(blocks, r, 2, "slices", lay).total_bytes
        assert s["gatherSeconds"] == 0
    for r in range(2):  # a layer's slices are half of it (norms replicated); the embedding is whole on every rank
        share = share_blocks(blocks, r, 2, "slices", lay).blocks
        for b in blocks.blocks.values():
            got = share[f"{b.id}@{r}/2"].nbytes
            if b.id.startswith("layer."):
                assert b.nbytes * 0.45 < got < b.nbytes * 0.55
            elif b.id == "head" and r == 1:
                assert got == blocks.config["hidden_size"] * 4  # the final norm only: no LM head


def test_a_rank_whose_plane_cannot_complete_fails_the_instance(tiny_ckpt: Path, tmp_path: Path) -> None:
    """Rank 1's plane names a source nobody runs: its transfer fails, so the instance never serves (non-zero
    exit, no tokens) instead of running with a rank that holds no weights."""
    blocks = pack_checkpoint(tiny_ckpt, model="tiny-llama")
    planes = _planes(blocks, 2, "parts")
    d = _write_planes(planes, blocks, "parts", tmp_path / "planes")
    src = Sources(planes[:1])  # plane 1's source never starts
    src.thread.start()
    assert src.ready.wait(30)
    args = [*_run_args(tiny_ckpt, 2, PROMPTS, TOKENS), "--plane-dir", str(d)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert '"tokens"' not in r.stdout
    assert "rank 1" in r.stderr or "t0.r1" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("g", [2, 4])
def test_parts_of_every_block_tile_it(tiny_blocks: BlockSet, g: int) -> None:
    shares = [share_blocks(tiny_blocks, r, g, "parts") for r in range(g)]
    for b in tiny_blocks.blocks.values():
        joined = b"".join(bytes(s.blocks[f"{b.id}#{r}/{g}"].data) for r, s in enumerate(shares)
                          if f"{b.id}#{r}/{g}" in s.blocks)
        assert joined == bytes(b.data)
        assert all(s.blocks[k].verify() for s in shares for k in s.blocks)


def _consecutive_ports(n: int, width: int) -> list[int]:
    """n base ports, each with the `width - 1` ports after it free too (rank r listens on base + r)."""
    return free_port_runs(n, width)


def test_tp2_engine_loads_by_plan_over_rank_ports_and_serves_the_source_text(tiny_ckpt: Path,
                                                                             tiny_blocks: BlockSet) -> None:
    """`serve --tp 2 --empty` is the target of an ordinary load-plan (the instance plan, unsharded): each rank
    receives its plane on the target's data port + rank, half the bytes each; then the instance serves exactly
    the TP-1 source's text, and its manifest (rank 0 kept the gathered blocks) makes it the next plan's source."""
    import httpx

    from .conftest import start_engine

    common = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
              "--kv-tokens", "4096"]
    src = start_engine(common)
    dst = start_engine([*common, "--tp", "2", "--empty"])
    h = {"Authorization": "Bearer test-token"}
    try:
        assert httpx.get(dst.url + "/kascade/v1/status", headers=h).json()["phase"] == "empty"
        plan = _instance_plan(tiny_blocks, 2).to_dict()
        pa, pb = _consecutive_ports(2, 2)
        doc = {"plan": plan, "peers": {"s0": f"127.0.0.1:{pa}", "t0": f"127.0.0.1:{pb}"}, "planToken": "pt"}
        whole = httpx.get(src.url + "/kascade/v1/manifest", headers=h).json()
        bad = httpx.post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "t0", "manifest": whole}, headers=h)
        assert bad.status_code == 400 and "manifest?parts=2" in bad.text, bad.text
        manifest = httpx.get(src.url + "/kascade/v1/manifest?parts=2", headers=h).json()
        assert "layer.0#1/2" in manifest and manifest["layer.0"] == whole["layer.0"]
        ok = httpx.post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "t0", "manifest": manifest},
                        headers=h)
        assert ok.status_code == 200, ok.text
        ok = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "s0"}, headers=h)
        assert ok.status_code == 200, ok.text
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = httpx.get(dst.url + "/kascade/v1/status", headers=h).json()
            if st["ready"] or st["loadError"]:
                break
            time.sleep(0.2)
        assert st["ready"] and st["loadError"] is None, st
        per_rank = sorted(st["tpLoad"], key=lambda s: s["rank"])
        for r, s in enumerate(per_rank):
            want = sum(hi - lo for b in tiny_blocks.blocks.values() for lo, hi in [part_range(b.nbytes, r, 2)])
            assert int(s["bytes"]) == want
        body = {"model": "tiny-llama", "prompt": "hello tensor parallel", "max_tokens": 8}
        want_text = httpx.post(src.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        got_text = httpx.post(dst.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert got_text == want_text
        assert httpx.get(dst.url + "/kascade/v1/manifest", headers=h).json() == whole
    finally:
        src.stop()
        dst.stop()


def test_a_rank_killed_mid_load_fails_the_instance_before_it_serves(tiny_ckpt: Path, tiny_blocks: BlockSet) -> None:
    """A follower rank dies while its plane is loading: the engine exits 3 (the pod restarts, the operator
    replaces the replica) and never reports ready with a rank missing."""
    import os
    import signal

    import httpx

    from .conftest import start_engine

    dst = start_engine(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
                        "--kv-tokens", "4096", "--tp", "2", "--empty"])
    h = {"Authorization": "Bearer test-token"}
    try:
        pa, pb = _consecutive_ports(2, 2)  # nobody runs the source: the planes wait for it
        doc = {"plan": _instance_plan(tiny_blocks, 2).to_dict(), "self": "t0", "planToken": "pt",
               "peers": {"s0": f"127.0.0.1:{pa}", "t0": f"127.0.0.1:{pb}"}, "timeoutSeconds": 60,
               "manifest": {**tiny_blocks.manifest(), **{k: v for r in range(2)
                                                         for k, v in share_blocks(tiny_blocks, r, 2, "parts")
                                                         .manifest().items()}}}
        ok = httpx.post(dst.url + "/kascade/v1/load-plan", json=doc, headers=h)
        assert ok.status_code == 200 and ok.json()["phase"] == "loading", ok.text
        kids = Path(f"/proc/{dst.proc.pid}/task/{dst.proc.pid}/children").read_text().split()
        assert len(kids) == 1, kids
        os.kill(int(kids[0]), signal.SIGKILL)
        assert dst.proc.wait(60) == 3
    finally:
        dst.stop()


def test_tp2_engine_binds_its_first_copy_from_a_path_on_every_rank(tiny_ckpt: Path) -> None:
    """The operator's first copy (`local` plan: bind with source.path) into `serve --tp 2 --empty`: every rank
    packs the directory and keeps its slices; the text equals the plain engine's."""
    import httpx

    from .conftest import start_engine

    common = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
              "--kv-tokens", "4096"]
    ref, dst = start_engine(common), start_engine([*common, "--tp", "2", "--empty"])
    h = {"Authorization": "Bearer test-token"}
    try:
        bind = {"model": "tiny-llama", "modelService": "svc", "role": "colocated", "source": {"path": str(tiny_ckpt)}}
        assert httpx.post(dst.url + "/kascade/v1/bind", json=bind, headers=h).status_code == 200
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            st = httpx.get(dst.url + "/kascade/v1/status", headers=h).json()
            if st["ready"] or st["loadError"]:
                break
            time.sleep(0.2)
        assert st["ready"], st
        body = {"model": "tiny-llama", "prompt": "first copy from disk", "max_tokens": 8}
        want = httpx.post(ref.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        assert httpx.post(dst.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
    finally:
        ref.stop()
        dst.stop()
