"""Bad checkpoints are refused before any digest, each error naming the file and the tensor (or the
field): truncated files, data_offsets inconsistent with shape x dtype, malformed headers, sharded
checkpoints with a missing shard or a wrong index, unsupported architectures and settings."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kascade_engine.weights.blocks import CheckpointError, pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_model


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("ck") / "base", "llama", layers=2)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("ck") / "sharded", "qwen2", layers=2, shard_bytes=40_000)


def _copy(src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(src, tmp_path / "variant"))


def _header(f: Path) -> tuple[int, dict]:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return n, json.loads(raw[8:8 + n])


def _write_header(f: Path, header: dict) -> None:
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))  # same length: the data area stays where it was
    assert len(new) == n
    f.write_bytes(raw[:8] + new + raw[8 + n:])


def test_truncated_file_names_file_and_tensor(base: Path, tmp_path: Path) -> None:
    d = _copy(base, tmp_path)
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: tensor '.+': data ends at byte \d+ .*\(truncated\?\)"
    ):
        pack_checkpoint(d)


def test_offsets_inconsistent_with_shape(base: Path, tmp_path: Path) -> None:
    d = _copy(base, tmp_path)
    f = d / "model.safetensors"
    _, h = _header(f)
    name = "model.layers.1.mlp.up_proj.weight"
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b, e - 4]
    _write_header(f, h)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}': data_offsets .* shape"):
        pack_checkpoint(d)


@pytest.mark.parametrize(("raw", "needle"), [
    (b"\x05", "only 1 bytes"),
    ((10**9).to_bytes(8, "little") + b"{}", "header length 1000000000 exceeds"),
    ((5).to_bytes(8, "little") + b"{oops", "header is not JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a JSON object"),
])
def test_malformed_header_names_file(base: Path, tmp_path: Path, raw: bytes, needle: str) -> None:
    d = _copy(base, tmp_path)
    (d / "model.safetensors").write_bytes(raw)
    with pytest.raises(CheckpointError, match=r"model\.safetensors") as e:
        pack_checkpoint(d)
    assert needle in str(e.value)


@pytest.mark.parametrize(("edit", "needle"), [
    ({"dtype": "F8_E4M3"}, "unsupported dtype F8_E4M3"),
    ({"shape": [64, -1]}, "is not a list of non-negative integers"),
    ({"data_offsets": [10, 5]}, "must be [begin, end]"),
])
def test_bad_header_entries_name_the_tensor(base: Path, tmp_path: Path, edit: dict, needle: str) -> None:
    d = _copy(base, tmp_path)
    f = d / "model.safetensors"
    _, h = _header(f)
    h["model.norm.weight"].update(edit)
    _write_header(f, h)
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight'") as e:
        pack_checkpoint(d)
    assert needle in str(e.value)


def test_sharded_missing_shard_and_wrong_index(sharded: Path, tmp_path: Path) -> None:
    blocks = pack_checkpoint(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and len(blocks.ids) == 4
    d = _copy(sharded, tmp_path)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[-1]
    (d / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"shard {shard} is missing \(it holds tensor '.+'\)"):
        pack_checkpoint(d)
    shutil.copy(sharded / shard, d / shard)
    name = next(n for n, f in idx["weight_map"].items() if f == shard)
    idx["weight_map"]["model.layers.9.mlp.up_proj.weight"] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.9.mlp.up_proj.weight'"):
        pack_checkpoint(d)
    idx["weight_map"].pop("model.layers.9.mlp.up_proj.weight")
    other = next(f for f in set(idx["weight_map"].values()) if f != shard)
    idx["weight_map"][name] = other
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is in {shard}, .* places it in {other}"):
        pack_checkpoint(d)


@pytest.mark.parametrize(("cfg", "needle"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
    ({"hidden_act": "gelu"}, "'hidden_act' = 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
])
def test_unsupported_architecture_or_setting(base: Path, tmp_path: Path, cfg: dict, needle: str) -> None:
    d = _copy(base, tmp_path)
    doc = json.loads((d / "config.json").read_text())
    doc.pop("rope_parameters", None) if "rope_scaling" in cfg else None
    (d / "config.json").write_text(json.dumps({**doc, **cfg}))
    if "rope_scaling" in cfg:  # rope settings are read by the model, not the packer
        from kascade_engine.batch.model import LlamaModel

        with pytest.raises(ValueError, match=needle):
            LlamaModel(json.loads((d / "config.json").read_text()))
        return
    with pytest.raises(CheckpointError, match=needle):
        pack_checkpoint(d)


def test_qwen3_without_qk_norm_names_the_tensor(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    d = tiny_model(tmp_path / "q3", "qwen3", layers=2)
    t = load_file(str(d / "model.safetensors"))
    t.pop("model.layers.1.self_attn.k_norm.weight")
    save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        pack_checkpoint(d)
