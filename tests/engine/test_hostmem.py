"""Host memory with the node cache, on real engine processes of one model on one node (this host), read from
/proc: a second replica maps the node's one copy instead of adding a private one (issue 35 item 3); a replica
loaded by plan ends on the node's copy too; an engine that neither serves from the copy nor keeps it leaves it
evictable."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.ports import free_ports
from kascade_devcluster.procmem import dir_mib, proc_mem
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_engine.weights.nodecache import NodeCache
from kascade_planner.baselines import build_star
from kascade_planner.plan import Instance, ModelLayout

BODY = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}


def _get(url: str, **kw: Any) -> httpx.Response:
    return httpx.get(url, timeout=60, **kw)  # engines answer slowly on shared cores under load


def _post(url: str, **kw: Any) -> httpx.Response:
    return httpx.post(url, timeout=120, **kw)


def _h(e) -> dict[str, str]:
    return {"Authorization": f"Bearer {e.token}"}


def _answer(e) -> str:
    r = _post(e.url + "/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def mid_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~68 MiB of fp32 weights: big enough that a private copy dominates the difference between engines."""
    return tiny_llama(tmp_path_factory.mktemp("mid") / "mid-llama", layers=4, hidden=512, vocab=8192)


def test_a_second_replica_adds_no_private_copy(mid_ckpt: Path, engine_starter, tmp_path: Path) -> None:
    from kascade_engine.weights.blocks import pack_checkpoint

    model_mib = pack_checkpoint(mid_ckpt, "m").total_bytes / (1 << 20)
    cache = Path("/dev/shm") / f"kascade-test-{tmp_path.name}"
    args = ["--checkpoint", str(mid_ckpt), "--model-name", "m", "--kv-tokens", "1024", "--max-seqs", "4"]
    engines = []
    try:
        private = engine_starter(args)  # today's replica: its own host copy
        engines.append(private)
        a = engine_starter([*args, "--node-cache-dir", str(cache)])  # packs and publishes the node's copy
        engines.append(a)
        b = engine_starter([*args, "--node-cache-dir", str(cache)])  # maps it
        engines.append(b)
        # a replica loaded by plan (the scale-up path) from a: it receives every block, then maps the node's copy
        # and drops what it received
        d = engine_starter([*args, "--empty", "--node-cache-dir", str(cache)])
        engines.append(d)
        _load_by_plan(a, d, pack_checkpoint(mid_ckpt, "m"))
        assert len({_answer(e) for e in engines}) == 1
        st = [_get(e.url + "/kascade/v1/status", headers=_h(e)).json() for e in (a, b, d)]
        assert st[0]["nodeCopy"] == st[1]["nodeCopy"] == st[2]["nodeCopy"] == str(cache / "m.kcache")
        assert [p.name for p in cache.glob("*.kcache")] == ["m.kcache"]
        # the node holds one copy: the cache file, of the model's size (header and 4 KiB alignment: < 1 MiB)
        assert model_mib <= dir_mib(cache) < model_mib + 1
        mp, ma, mb, md = (proc_mem(e.proc.pid) for e in engines)
        # A private copy is the model's bytes of anonymous memory (RssAnon). Engines otherwise differ by allocator
        # and lazily grown buffers (a few MiB between runs here): half the model is the margin, far above that and
        # far below a copy. The writer (a) dropped its packed bytes for the mapping; the reader (b) never had any.
        for who, m in (("writer", ma), ("reader", mb), ("plan-loaded", md)):
            assert m["RssAnon"] < mp["RssAnon"] - model_mib / 2, (who, m, mp, model_mib)
        # the reader's weights are the node's pages: every layer and the head are read by a forward, the embedding
        # only at the prompt's rows, so at least half the model is mapped shared
        assert mb["RssShmem"] > model_mib / 2, (mb, model_mib)
        # and every engine maps the copy once: its shared pages never exceed one copy (the plan's source went on
        # serving from its mapping; it mapped the file again after the plan before this was fixed)
        for m in (ma, mb, md):
            assert m["RssShmem"] <= model_mib + 1, (m, model_mib)
        # Pss counts a shared page once over its mappers: two cache engines sum to less than two private ones by
        # at least half a copy (the same margin as above)
        assert ma["Pss"] + mb["Pss"] < 2 * mp["Pss"] - model_mib / 2, (ma, mb, mp)
    finally:
        for e in engines:
            e.stop()
        for p in cache.glob("*"):
            p.unlink()
        cache.rmdir() if cache.exists() else None


def _load_by_plan(src, dst, blocks) -> dict:
    """`dst` loads every block from `src` by a one-hop plan; its status once ready on the node's copy."""
    layout = ModelLayout(blocks.model, blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = build_star(layout, [Instance("a", "n0")], [Instance("b", "n0")]).to_dict()
    pa, pb = free_ports(2)
    doc = {"plan": plan, "peers": {"a": f"127.0.0.1:{pa}", "b": f"127.0.0.1:{pb}"}, "planToken": "pt"}
    ok = _post(dst.url + "/kascade/v1/load-plan", json={**doc, "self": "b", "manifest": blocks.manifest()},
                    headers=_h(dst))
    assert ok.status_code == 200, ok.text
    ok = _post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "a"}, headers=_h(src))
    assert ok.status_code == 200, ok.text
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        st = _get(dst.url + "/kascade/v1/status", headers=_h(dst)).json()
        if (st["ready"] and st.get("nodeCopy")) or st["loadError"]:
            return dict(st)
        time.sleep(0.05)
    raise AssertionError(f"never ready on the node's copy: {st}")


def test_a_plan_loaded_replica_ends_on_the_node_copy_and_releases_it(tiny_ckpt, tiny_blocks, engine_starter,
                                                                      tmp_path: Path) -> None:
    cache = tmp_path / "node"
    src = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--node-cache-dir",
                          str(cache)])
    dst = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty",
                          "--node-cache-dir", str(cache), "--host-cache-gib", "1"])
    body = {**BODY, "model": "tiny-llama"}
    try:
        st = _load_by_plan(src, dst, tiny_blocks)
        assert st["ready"] and st["loadError"] is None and st["nodeCopy"] == str(cache / "tiny-llama.kcache"), st
        want = _post(src.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        assert _post(dst.url + "/v1/completions", json=body).json()["choices"][0]["text"] == want
        node = NodeCache(cache, 1 << 30)
        assert [e.in_use for e in node.entries()] == [True]
        for e in (src, dst):
            _post(e.url + "/kascade/v1/drain", headers=_h(e))
        assert _post(src.url + "/kascade/v1/release", headers=_h(src)).json()["hostCopyBytes"] == 0
        kept = _post(dst.url + "/kascade/v1/release", headers=_h(dst)).json()  # its host copy: the node's
        assert kept["hostCopyBytes"] == tiny_blocks.total_bytes and kept["nodeCopy"] == str(cache / "tiny-llama.kcache")
        assert [e.in_use for e in node.entries()] == [True]  # kept as dst's host copy: not evictable
        assert _post(dst.url + "/kascade/v1/release", json={"keepHostCopy": False},
                          headers=_h(dst)).json()["hostCopyBytes"] == 0
        assert [e.in_use for e in node.entries()] == [False]  # nobody serves from it or keeps it
        assert node.evict(1 << 30) == ["tiny-llama.kcache"]
    finally:
        src.stop()
        dst.stop()


def test_an_engine_binds_from_the_node_copy_with_nothing_over_the_network(tiny_ckpt, engine_starter,
                                                                          tmp_path: Path) -> None:
    """Bind source.nodeCopy (issue 35 item 3, a scale-up target on a node keeping the model's copy): the engine maps
    the copy another engine of its node published, answers the same greedy text, and nothing reaches it over the
    network: it is in no plan, and the keeper is SIGSTOPped while it loads (no engine could send it a byte)."""
    import os
    import signal

    cache = tmp_path / "node"
    keeper = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--node-cache-dir",
                             str(cache)])
    empty = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty",
                            "--node-cache-dir", str(cache)])
    private = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    body = {**BODY, "model": "tiny-llama"}
    bind = {"model": "tiny-llama", "modelService": "ns/svc", "role": "colocated", "source": {"nodeCopy": True}}
    try:
        want = _post(keeper.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        os.kill(keeper.proc.pid, signal.SIGSTOP)
        try:
            r = _post(empty.url + "/kascade/v1/bind", json=bind, headers=_h(empty))
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 120
            while not (st := _get(empty.url + "/kascade/v1/status", headers=_h(empty)).json())["ready"]:
                assert st["loadError"] is None and time.monotonic() < deadline, st
                time.sleep(0.05)
        finally:
            os.kill(keeper.proc.pid, signal.SIGCONT)
        assert st["phase"] == "serving" and st["nodeCopy"] == str(cache / "tiny-llama.kcache"), st
        assert _post(empty.url + "/v1/completions", json=body).json()["choices"][0]["text"] == want
        metrics = _get(empty.url + "/metrics").text
        received = [ln for ln in metrics.splitlines() if ln.startswith("kascade_data_port_bytes_total")
                    and 'direction="received"' in ln]
        assert received and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in received), received
        # an engine without a node cache refuses the source naming the field; so does one whose node holds none
        r = _post(private.url + "/kascade/v1/bind", json=bind, headers=_h(private))
        assert r.status_code == 409 and "source.nodeCopy" in r.text and "--node-cache-dir" in r.text, r.text
        r = _post(empty.url + "/kascade/v1/bind", json={**bind, "source": {"nodeCopy": "yes"}}, headers=_h(empty))
        assert r.status_code in (400, 422) and "source.nodeCopy" in r.text, r.text
    finally:
        for e in (keeper, empty, private):
            e.stop()


def test_an_engine_refuses_a_node_copy_its_node_does_not_hold(tiny_ckpt, engine_starter, tmp_path: Path) -> None:
    empty = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty",
                            "--node-cache-dir", str(tmp_path / "node")])
    try:
        r = _post(empty.url + "/kascade/v1/bind", headers=_h(empty), json={
            "model": "tiny-llama", "modelService": "ns/svc", "role": "colocated", "source": {"nodeCopy": True}})
        assert r.status_code == 409 and "no usable copy of tiny-llama" in r.text, r.text
    finally:
        empty.stop()
