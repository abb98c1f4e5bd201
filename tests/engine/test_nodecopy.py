"""The engine's side of the node cache (kascade_engine.weights.nodecopy): a valid node copy is mapped instead of
the source; a damaged, half-written, or mismatched one (another model, another dtype) is not used, the engine
loads from its source, says so in its log naming what is wrong, and replaces it; a crashed writer's leftovers are
found and removed, a live writer's are not."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from kascade_engine.weights.blocks import BlockSet, pack_checkpoint
from kascade_engine.weights.hostcache import write_cache
from kascade_engine.weights.nodecache import NodeCache
from kascade_engine.weights.nodecopy import NodeCopies, load_checkpoint

MODEL = "tiny-llama"


def _node(root: Path) -> NodeCopies:
    return NodeCopies(NodeCache(root, 1 << 30))


def test_a_second_engine_maps_the_node_copy_instead_of_the_source(tmp_path: Path, tiny_ckpt: Path,
                                                                   tiny_blocks: BlockSet) -> None:
    first = _node(tmp_path)
    got = load_checkpoint(first, tiny_ckpt, MODEL)
    assert got.manifest() == tiny_blocks.manifest() and first.path == str(first.cache.path(MODEL))
    # the source is gone: the second engine can only have its weights from the node's copy
    src = tmp_path / "src"
    shutil.copytree(tiny_ckpt, src)
    second = _node(tmp_path)
    for f in src.glob("*.safetensors"):  # headers stay (the dtype check reads them), the bytes are zeroed
        raw = bytearray(f.read_bytes())
        n = 8 + int.from_bytes(raw[:8], "little")
        raw[n:] = bytes(len(raw) - n)
        f.write_bytes(raw)
    again = load_checkpoint(second, src, MODEL)
    assert again.manifest() == tiny_blocks.manifest()
    assert all(b.verify() for b in again.blocks.values())
    assert [e.in_use for e in first.cache.entries()] == [True]
    first.drop()
    second.drop()
    assert [e.in_use for e in first.cache.entries()] == [False]  # evictable now


def _damage(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(raw)


@pytest.mark.parametrize("how, said", [("corrupt", "fails its digest"), ("half-written", "incomplete"),
                                       ("truncated", "extends past the end")])
def test_a_damaged_copy_is_not_used_and_the_engine_loads_from_its_source(
        tmp_path: Path, tiny_ckpt: Path, tiny_blocks: BlockSet, caplog: pytest.LogCaptureFixture,
        how: str, said: str) -> None:
    cache = NodeCache(tmp_path, 1 << 30)
    assert cache.publish(tiny_blocks)[0]
    p = cache.path(MODEL)
    if how == "corrupt":
        _damage(p, p.stat().st_size - 10)  # a byte of the head block
    elif how == "half-written":
        with open(p, "r+b") as f:
            f.write(bytes(8))  # no completion marker: the writer died before it
    else:
        with open(p, "r+b") as f:
            f.truncate(p.stat().st_size // 2)
    node = _node(tmp_path)
    with caplog.at_level(logging.INFO, logger="kascade_engine.weights.nodecopy"):
        got = load_checkpoint(node, tiny_ckpt, MODEL)
    assert got.manifest() == tiny_blocks.manifest() and all(b.verify() for b in got.blocks.values())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "damaged" in warned[0] and said in warned[0] and "loading from the source" in warned[0]
    # replaced by a good copy of the source, which the engine now maps
    fresh = NodeCache(tmp_path, 1 << 30).attach(MODEL)
    assert node.path == str(p) and fresh is not None and all(b.verify() for b in fresh.blocks.blocks.values())


def _f16_checkpoint(src: Path, out: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({k: v.to(torch.float16) for k, v in load_file(f).items()}, out / f.name, {"format": "pt"})
        else:
            shutil.copy(f, out / f.name)
    return out


def test_a_copy_of_another_dtype_or_model_is_refused_naming_the_mismatch(
        tmp_path: Path, tiny_ckpt: Path, tiny_blocks: BlockSet, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cache"
    cache = NodeCache(root, 1 << 30)
    f16 = pack_checkpoint(_f16_checkpoint(tiny_ckpt, tmp_path / "f16"), MODEL)
    assert cache.publish(f16)[0]  # the node holds tiny-llama in F16; this engine's source is F32
    node = _node(root)
    with caplog.at_level(logging.WARNING, logger="kascade_engine.weights.nodecopy"):
        got = load_checkpoint(node, tiny_ckpt, MODEL)
    assert got.manifest() == tiny_blocks.manifest()
    msg = caplog.records[0].getMessage()
    assert "refused: dtype: tensor 'model.embed_tokens.weight' is F16 in the node's copy, F32 in the source" in msg
    node.drop()
    # another model's blocks under this model's name (a copy placed by hand, or a name collision)
    other = BlockSet("other-model", tiny_blocks.config, tiny_blocks.blocks.values())
    cache.path(MODEL).unlink()
    write_cache(cache.path(MODEL), other)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kascade_engine.weights.nodecopy"):
        load_checkpoint(_node(root), tiny_ckpt, MODEL)
    assert "refused: model: the node's copy is of 'other-model', this engine serves 'tiny-llama'" in \
        caplog.records[0].getMessage()
    # another architecture under the name: a shape names the tensor
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    from kascade_engine.weights.nodecopy import mismatch

    wider = {**cfg, "hidden_size": cfg["hidden_size"] * 2}
    assert (mismatch(tiny_blocks, MODEL, wider, None) or "").startswith("shape: tensor 'model.embed_tokens.weight'")


def test_a_crashed_writers_leftovers_are_removed_a_live_writers_are_not(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 1 << 30)
    dead = tmp_path / "dead.kcache.tmp"
    dead.write_bytes(b"x" * 4096)  # no process holds its writer lock: its writer crashed
    live = tmp_path / "live.kcache.tmp"
    live.write_bytes(b"y" * 4096)
    fd = os.open(tmp_path / ".live.kcache.lock", os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a writer at work (another open file description)
        assert cache.stale() == [dead]
        assert cache.used_bytes() == 8192  # files being written are host memory too
        assert cache.clean() == ["dead.kcache.tmp"]
        assert not dead.exists() and live.exists()
    finally:
        os.close(fd)
    assert cache.clean() == ["live.kcache.tmp"]  # its writer is gone now


def test_without_room_or_a_usable_directory_the_engine_keeps_a_private_copy_and_says_why(
        tmp_path: Path, tiny_ckpt: Path, tiny_blocks: BlockSet, caplog: pytest.LogCaptureFixture) -> None:
    from kascade_engine.config import ConfigError, EngineConfig
    from kascade_engine.weights.nodecopy import node_copies

    small = NodeCopies(NodeCache(tmp_path / "small", tiny_blocks.total_bytes // 2))
    with caplog.at_level(logging.INFO, logger="kascade_engine.weights.nodecopy"):
        got = load_checkpoint(small, tiny_ckpt, MODEL)
    assert got.manifest() == tiny_blocks.manifest() and small.path is None and small.cache.entries() == []
    assert any("keeping a private host copy" in r.getMessage() and "budget" in r.getMessage() for r in caplog.records)
    # a damaged copy another engine still maps is neither removed nor used: the engine verifies what it maps
    cache = NodeCache(tmp_path / "held", 1 << 30)
    assert cache.publish(tiny_blocks)[0]
    holder = cache.attach(MODEL)
    assert holder is not None
    _damage(cache.path(MODEL), cache.path(MODEL).stat().st_size - 10)
    node = NodeCopies(cache)
    got = load_checkpoint(node, tiny_ckpt, MODEL)
    assert node.path is None and all(b.verify() for b in got.blocks.values()) and cache.path(MODEL).exists()
    holder.close()
    # a directory the engine cannot use: no node cache, said loudly
    (tmp_path / "file").write_text("")
    cfg = EngineConfig(tiny_ckpt, MODEL, "t", node_cache_dir=tmp_path / "file" / "sub")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="kascade_engine.weights.nodecopy"):
        assert node_copies(cfg) is None
    assert "--node-cache-dir" in caplog.records[0].getMessage()
    with pytest.raises(ConfigError, match="--node-cache-gib"):
        EngineConfig(tiny_ckpt, MODEL, "t", node_cache_bytes=-1)
    with pytest.raises(ConfigError, match="--node-cache-dir with --tp"):
        EngineConfig(tiny_ckpt, MODEL, "t", node_cache_dir=tmp_path, tp=2)
