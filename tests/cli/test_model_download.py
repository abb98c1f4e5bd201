"""`kascade model download` (the chart pool's init container). The Hub is not reachable from the test
machines: the download itself is replaced by a function writing files, so what is tested is the
command's own behaviour (argument checks, the pattern list, the summary, the no-weights error)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kascade_cli.main import cli


def test_downloads_config_tokenizer_and_weights_into_dest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    calls: list[dict[str, Any]] = []

    def fake(**kw: Any) -> str:
        calls.append(kw)
        Path(kw["local_dir"], "config.json").write_text("{}")
        Path(kw["local_dir"], "model.safetensors").write_bytes(b"\0" * 2048)
        return str(kw["local_dir"])

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    r = CliRunner().invoke(cli, ["model", "download", "org/m", "--dest", str(tmp_path / "m"), "--revision", "abc"])
    assert r.exit_code == 0, r.output
    assert calls[0]["repo_id"] == "org/m" and calls[0]["revision"] == "abc"
    assert "*.safetensors" in calls[0]["allow_patterns"] and "*.bin" not in calls[0]["allow_patterns"]
    assert "org/m@abc: 2 files" in r.output


def test_no_weights_and_bad_repo_are_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: str(kw["local_dir"]))
    r = CliRunner().invoke(cli, ["model", "download", "org/m", "--dest", str(tmp_path / "m")])
    assert r.exit_code == 1 and "no .safetensors" in r.output
    r = CliRunner().invoke(cli, ["model", "download", "just-a-name", "--dest", str(tmp_path / "m")])
    assert r.exit_code == 2 and "OWNER/NAME" in r.output


def test_config_only_from_a_hub_at_hf_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a local Hub (real HTTP, real snapshot_download): --config-only fetches config but no
    weights (a fallback pod's init container for an hf:// source)."""
    from kascade_devcluster.hubserver import HubServer

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text('{"num_hidden_layers": 2}')
    (src / "model.safetensors").write_bytes(b"\0" * 64)
    hub = HubServer()
    hub.add("org/m", src)
    hub.start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        r = CliRunner().invoke(cli, ["model", "download", "org/m", "--dest", str(tmp_path / "m"), "--config-only"])
        assert r.exit_code == 0, r.output
        assert (tmp_path / "m" / "config.json").read_text() == '{"num_hidden_layers": 2}'
        assert not (tmp_path / "m" / "model.safetensors").exists()
        assert not any("model.safetensors" in x for x in hub.requests if "/resolve/" in x)
        r = CliRunner().invoke(cli, ["model", "download", "org/nope", "--dest", str(tmp_path / "n")])
        assert r.exit_code == 1 and "org/nope@main" in r.output
    finally:
        hub.stop()


def test_a_hub_that_does_not_answer_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a pool pod saw it on kind (its Hub unreachable): not a traceback, the endpoint and what to check."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    r = CliRunner().invoke(cli, ["model", "download", "org/m", "--dest", str(tmp_path / "m")])
    assert r.exit_code == 1, r.output
    assert f"org/m@main: the Hub at http://127.0.0.1:{port} did not answer" in r.output, r.output
    assert "pool.model.download.endpoint" in r.output and "Traceback" not in r.output
