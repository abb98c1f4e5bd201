"""`kascade engine serve` refuses bad flags with messages naming them (no server starts)."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kascade_cli.engine import engine


def _run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    r = CliRunner().invoke(engine, ["serve", *args], env=env or {"KASCADE_ENGINE_TOKEN": "t"})
    return r.exit_code, r.output


def test_serve_bad_flags(tmp_path: Path, tiny_ckpt: Path) -> None:
    code, out = _run()
    assert code == 2 and "exactly one of --checkpoint DIR or --smollm" in out
    code, out = _run("--checkpoint", str(tmp_path / "nope"))
    assert code == 2 and "--checkpoint" in out and "does not exist" in out
    code, out = _run("--checkpoint", str(tiny_ckpt), env={"KASCADE_ENGINE_TOKEN": ""})
    assert code == 2 and "no control token" in out
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    code, out = _run("--checkpoint", str(tmp_path))
    assert code == 2 and "missing field 'intermediate_size'" in out
    code, out = _run("--checkpoint", str(tmp_path), "--empty")
    assert code == 2 and "num_attention_heads" in out
    code, out = _run("--checkpoint", str(tiny_ckpt), "--resident-layers", "9")
    assert code == 2 and "exceeds the model's 4 layers" in out
    code, out = _run("--checkpoint", str(tiny_ckpt), "--port", "70000")
    assert code == 2 and "--port" in out


def test_byte_tokenizer_round_trip() -> None:
    from kascade_engine.tokenizer import ByteTokenizer

    t = ByteTokenizer()
    assert t.decode(t.encode("héllo")) == "héllo"
    assert t.decode(t.chat_prompt([{"role": "user", "content": "hi"}])).endswith("assistant: ")
