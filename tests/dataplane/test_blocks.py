"""Blocks and the host-cache file: packing, zero-copy views, and refusing bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from kascade_engine.weights.blocks import CheckpointError, pack_checkpoint
from kascade_engine.weights.hostcache import open_cache, write_cache


def test_pack_groups_tensors_by_layer_and_views_match(tmp_path: Path, harness: ModuleType) -> None:
    ck = harness.tiny_checkpoint(tmp_path / "ck", layers=3)
    blocks = pack_checkpoint(ck)
    assert blocks.ids == ("embed", "layer.0", "layer.1", "layer.2", "head")
    ref = load_file(str(ck / "model.safetensors"))
    for b in blocks.blocks.values():
        assert b.verify()
        for name, t in b.tensors().items():
            assert torch.equal(t, ref[name]), name
    assert set(blocks.blocks["head"].tensors()) == {"model.norm.weight", "lm_head.weight"}
    assert len(blocks.blocks["layer.1"].index) == 9


def _variant(tmp_path: Path, harness: ModuleType, edit: object) -> Path:
    src = harness.tiny_checkpoint(tmp_path / "base", layers=2)
    dst = tmp_path / "variant"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors, dst)  # type: ignore[operator]
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t, d: (t.pop("model.layers.1.mlp.up_proj.weight"), save_file(t, str(d / "model.safetensors"))),
            "missing tensor 'model.layers.1.mlp.up_proj.weight'",
        ),
        (
            lambda t, d: (
                t.__setitem__("model.norm.weight", torch.zeros(3)),
                save_file(t, str(d / "model.safetensors")),
            ),
            "tensor 'model.norm.weight' has shape [3], expected [64]",
        ),
        (
            lambda t, d: (
                t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)),
                save_file(t, str(d / "model.safetensors")),
            ),
            "unexpected tensor 'model.layers.0.extra.weight'",
        ),
        (
            lambda t, d: save_file({"model.norm.weight": t["model.norm.weight"]}, str(d / "model-2.safetensors")),
            "tensor 'model.norm.weight' is duplicated",
        ),
        (lambda t, d: (d / "config.json").write_text(json.dumps({"hidden_size": 64})), "missing field"),
        (
            lambda t, d: (d / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops"),
            "not a safetensors file",
        ),
    ],
    ids=["missing", "misshaped", "unexpected", "duplicated", "bad-config", "garbage"],
)
def test_bad_checkpoints_are_refused_naming_the_tensor(
    tmp_path: Path, harness: ModuleType, edit: object, message: str
) -> None:
    with pytest.raises(CheckpointError) as e:
        pack_checkpoint(_variant(tmp_path, harness, edit))
    assert message in str(e.value)


def test_host_cache_round_trip_is_mapped_and_checked(tmp_path: Path, tiny_blocks: object) -> None:
    from kascade_engine.weights.blocks import BlockSet

    assert isinstance(tiny_blocks, BlockSet)
    path = tmp_path / "m.kcache"
    write_cache(path, tiny_blocks)
    back = open_cache(path, verify=True)
    assert back.manifest() == tiny_blocks.manifest()
    # Views are writable (copy-on-write) so torch can wrap them, yet the file never changes.
    t = back.blocks["layer.0"].tensors()["model.layers.0.input_layernorm.weight"]
    t += 1
    assert open_cache(path, verify=True).blocks["layer.0"].verify()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    (tmp_path / "bad.kcache").write_bytes(raw)
    with pytest.raises(CheckpointError, match="block 'head' fails its digest"):
        open_cache(tmp_path / "bad.kcache", verify=True)
    (tmp_path / "short.kcache").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="extends past the end"):
        open_cache(tmp_path / "short.kcache")
    (tmp_path / "x.kcache").write_bytes(b"NOTKASCADE")
    with pytest.raises(CheckpointError, match="bad magic"):
        open_cache(tmp_path / "x.kcache")


def test_digests_name_their_algorithm_and_legacy_sha256_still_verifies() -> None:
    import hashlib

    from kascade_engine.weights.blocks import digest_matches, digest_of

    data = bytes(range(256)) * 1000
    d = digest_of(data)
    assert d.startswith("xxh3-128:") and len(d) == len("xxh3-128:") + 32
    assert digest_matches(data, d) and not digest_matches(data[:-1] + b"\x00", d)
    legacy = hashlib.sha256(data).hexdigest()  # a host cache written with sha256 digests
    assert digest_matches(data, legacy) and not digest_matches(b"x" + data[1:], legacy)
    assert not digest_matches(data, "md5:" + "0" * 32)  # an unknown algorithm never matches
