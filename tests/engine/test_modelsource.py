"""`hf://` model sources: an empty engine bound with `source.uri` downloads the snapshot from a Hub
(a local HubServer speaking the Hub's HTTP endpoints, pointed to by HF_ENDPOINT; a real tiny checkpoint)
and answers exactly like an engine loaded from the directory; a malformed URI, an unknown repo and a
rejected token each fail with a message naming the field and the cause."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kascade_devcluster.hubserver import HubServer
from kascade_engine.config import EngineConfig
from kascade_engine.instance import EngineInstance
from kascade_engine.refusal import InstanceError
from kascade_engine.tokenizer import ByteTokenizer
from kascade_engine.weights.modelsource import HubSource, SourceError, parse_uri, resolve
from kascade_planner.engine_api import BindRequest, WireError

TOKEN = "hf_good_token"


@pytest.fixture(scope="module")
def hub(tiny_ckpt: Path) -> Iterator[HubServer]:
    h = HubServer()
    h.add("kascade/tiny", tiny_ckpt)
    h.add("kascade/tiny-private", tiny_ckpt, token=TOKEN)
    h.start()
    yield h
    h.stop()


@pytest.mark.parametrize("uri", ["hf://tiny", "hf://a/b/c", "hf://../b", "hf://a/b@", "s3://a/b", "hf:/a/b",
                                 "hf://a/b@../x", "file://relative"])
def test_malformed_uris_are_refused(uri: str) -> None:
    with pytest.raises(SourceError, match="not a model URI"):
        parse_uri(uri)


def test_uri_forms() -> None:
    assert parse_uri("hf://HuggingFaceTB/SmolLM2-135M-Instruct") == HubSource("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert parse_uri("hf://org/m@v1.0") == HubSource("org/m", "v1.0")
    assert parse_uri("file:///models/m") == Path("/models/m")
    b = BindRequest("m", "s", source_uri="hf://org/m@main")
    assert BindRequest.from_dict(b.to_dict()) == b and b.to_dict()["source"] == {"uri": "hf://org/m@main"}
    with pytest.raises(WireError, match="source"):
        BindRequest.from_dict({"model": "m", "modelService": "s", "role": "colocated",
                               "source": {"path": "/x", "uri": "hf://a/b"}})


def test_resolve_downloads_once_and_names_hub_errors(hub: HubServer, tiny_ckpt: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.requests.clear()
    d = resolve("hf://kascade/tiny-private@main", tmp_path)
    for f in ("config.json", "model.safetensors"):
        assert (d / f).read_bytes() == (tiny_ckpt / f).read_bytes()
    assert {p.name for p in d.iterdir()} >= {"config.json", "model.safetensors"}
    assert sum(r.startswith("GET /kascade/tiny-private/resolve/") for r in hub.requests) == len(list(d.iterdir()))
    hub.requests.clear()
    assert resolve("hf://kascade/tiny-private", tmp_path) == d  # cached: only the revision is asked
    assert not any("/resolve/" in r for r in hub.requests)
    with pytest.raises(SourceError, match=r"hf://kascade/nope@main .*not found"):
        resolve("hf://kascade/nope", tmp_path / "b")
    with pytest.raises(SourceError, match=r"revision 'v9' not found"):
        resolve("hf://kascade/tiny@v9", tmp_path / "b")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(SourceError, match=r"rejected HF_TOKEN \(HTTP 401"):
        resolve("hf://kascade/tiny-private", tmp_path / "c")
    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(SourceError, match=r"not found or not accessible"):
        resolve("hf://kascade/tiny-private", tmp_path / "c")


async def test_bind_with_unreachable_source_reports_load_error(hub: HubServer, tiny_ckpt: Path, tiny_blocks,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    inst = EngineInstance(EngineConfig(tiny_ckpt, "tiny-llama", "tok", device="cpu", empty=True), tiny_blocks.config,
                          ByteTokenizer())
    try:
        with pytest.raises(InstanceError) as e:
            await inst.bind(BindRequest("tiny-llama", "svc", source_uri="hf://kascade"))
        assert e.value.status == 400 and "source.uri" in str(e.value)
        for uri, why in (("hf://kascade/missing", "not found"), ("hf://kascade/tiny-private", "HTTP 401")):
            await inst.bind(BindRequest("tiny-llama", "svc", source_uri=uri))
            assert inst.loading is not None
            await asyncio.wait_for(inst.loading, 120)
            assert inst.load_error is not None and inst.load_error.startswith("source.uri (spec.model.source.uri): ")
            assert uri in inst.load_error and why in inst.load_error, inst.load_error
            assert not inst.model.complete
    finally:
        await inst.close()


def test_engine_bound_with_hf_uri_answers_like_path_engine(hub: HubServer, tiny_ckpt: Path, tiny_blocks,
                                                           engine_a, engine_starter, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    e = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty",
                        "--max-prompt-tokens", "64", "--kv-tokens", "4096"])
    try:
        h = {"Authorization": f"Bearer {e.token}"}
        bind = {"model": "tiny-llama", "modelService": "svc", "role": "colocated"}
        bad = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "source": {"uri": "hf://no-slash"}}, headers=h)
        assert bad.status_code == 400 and "source.uri" in bad.json()["error"]["message"], bad.text
        ok = httpx.post(e.url + "/kascade/v1/bind", json={**bind, "source": {"uri": "hf://kascade/tiny-private"}},
                        headers=h, timeout=60)
        assert ok.status_code == 200, ok.text
        st = ok.json()
        for _ in range(1200):  # bounded by iterations, not by a clock: each status call is a round trip
            st = httpx.get(e.url + "/kascade/v1/status", headers=h, timeout=60).json()
            if st["phase"] == "serving" or st.get("loadError"):
                break
            time.sleep(0.1)
        assert st["phase"] == "serving" and st["loadError"] is None, st
        assert st["bytesReceived"] == tiny_blocks.total_bytes
        assert httpx.get(e.url + "/kascade/v1/manifest", headers=h).json() == tiny_blocks.manifest()
        assert any(p.name == "model.safetensors" for p in (tmp_path / "hub").rglob("*"))
        for prompt in ([7, 8, 9], [1, 2, 3, 4, 5]):
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 6, "temperature": 0}
            want = httpx.post(engine_a.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            got = httpx.post(e.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            assert got == want
    finally:
        e.stop()
