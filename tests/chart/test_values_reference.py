"""docs/values.md is generated from values.yaml and values.schema.json (hack/gen_values_reference.py): it
is current, documents every key values.yaml sets, and the comment parser attaches comments to the right
keys (the block right above a key, its inline comment; blank lines and list items break blocks)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "hack" / "gen_values_reference.py"


def gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_values_reference", GEN)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def leaves(d: Any, path: str = "") -> list[str]:
    if isinstance(d, dict) and d:
        return [p for k, v in d.items() for p in leaves(v, f"{path}.{k}" if path else k)]
    return [path]


def test_values_reference_is_current_and_complete() -> None:
    out = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr  # stale or a key without a description: run the generator
    doc = (REPO / "docs" / "values.md").read_text()
    values = yaml.safe_load((REPO / "charts" / "kascade" / "values.yaml").read_text())
    common = gen().COMMON
    for path in leaves(values):
        # every key is a row, or lies under an open-object row (resources.requests under resources)
        prefixes = [".".join(path.split(".")[:i]) for i in range(len(path.split(".")), 0, -1)]
        assert any(f"| `{p}` |" in doc for p in prefixes), f"{path} is not in docs/values.md"
        assert not any(p.rsplit(".", 1)[-1] in common and f"| `{p}.`" in doc for p in prefixes)
    assert "| `router.maxQueued` | integer (≥ 0) | `256` | held requests per model beyond this get 429 |" in doc


def test_comment_parser_attaches_blocks_and_inline_comments() -> None:
    text = """# file header

# about a
a:
  # about b
  # continued
  b: 1   # inline b
  c: []
  d:
    - x: 1   # inside a list: not a key
  e: "#notacomment"

# about f
f: {}
"""
    notes = gen().comments(text)
    assert notes["a"] == "about a"
    assert notes["a.b"] == "about b continued inline b"
    assert notes["a.c"] == "" and notes["a.d"] == "" and notes["a.e"] == ""
    assert notes["f"] == "about f" and "a.d.x" not in notes and "x" not in notes


def test_a_key_without_a_description_is_reported(tmp_path: Path, monkeypatch: Any) -> None:
    mod = gen()
    chart = tmp_path / "chart"
    chart.mkdir()
    (chart / "values.yaml").write_text("# documented\nlogFormat: text\nnewKnob: 3\n")
    (chart / "values.schema.json").write_text(
        '{"type": "object", "properties": {"logFormat": {"enum": ["text", "json"]}, "newKnob": {"type": "integer"}}}')
    monkeypatch.setattr(mod, "CHART", chart)
    doc, missing = mod.render()
    assert missing == ["newKnob"]
    assert "| `logFormat` | `text` \\| `json` | `text` | documented |" in doc
