"""`kascade --log-format json`: one logging setup for every entry point. Unit: the JSON formatter and
the root option. Real: an engine process (uvicorn inside) started with `--log-format json` writes only
JSON lines to stderr, and `kascade probe models` (what `helm test` runs) passes and fails against it."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from kascade_cli import logsetup
from kascade_cli.main import cli

pytestmark = pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def test_json_lines_carry_level_logger_message_extras_and_exceptions(restore_root: None) -> None:
    buf = io.StringIO()
    logsetup.configure(logging.INFO, "json", stream=buf)
    log = logging.getLogger("kascade_test.json")
    log.info("bound %s to %s\nsecond line", "pod-1", "svc", extra={"plan": "svc-up-1"})
    log.debug("not at INFO")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2, lines  # one line per record, the newline in the message escaped
    first, second = (json.loads(x) for x in lines)
    assert first["msg"] == "bound pod-1 to svc\nsecond line" and first["level"] == "info"
    assert first["logger"] == "kascade_test.json" and first["plan"] == "svc-up-1" and first["ts"].endswith("+00:00")
    assert second["level"] == "error" and "ValueError: boom" in second["exc"]


def test_configure_replaces_only_its_own_handler_and_rejects_unknown_formats(restore_root: None) -> None:
    root = logging.getLogger()
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    logsetup.configure(logging.INFO, "text")
    logsetup.configure(logging.DEBUG, "json")
    ours = [h for h in root.handlers if isinstance(h.formatter, logsetup.JsonFormatter | logging.Formatter)
            and h is not foreign and type(h).__name__ == "_StderrHandler"]
    assert len(ours) == 1 and isinstance(ours[0].formatter, logsetup.JsonFormatter) and foreign in root.handlers
    with pytest.raises(ValueError, match="xml"):
        logsetup.configure(logging.INFO, "xml")  # type: ignore[arg-type]


def test_root_option_and_environment_select_the_format(restore_root: None) -> None:
    r = CliRunner().invoke(cli, ["--log-format", "json", "version"])
    assert r.exit_code == 0
    handler = next(h for h in logging.getLogger().handlers if type(h).__name__ == "_StderrHandler")
    assert isinstance(handler.formatter, logsetup.JsonFormatter)
    r = CliRunner().invoke(cli, ["version"], env={"KASCADE_LOG_FORMAT": "yaml"})
    assert r.exit_code != 0 and "yaml" in r.output and "--log-format" in r.output


@pytest.fixture(scope="module")
def json_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    from kascade_engine.weights.checkpoint import tiny_llama

    d = tmp_path_factory.mktemp("logjson")
    ckpt = tiny_llama(d / "tiny-log", layers=1, hidden=32, vocab=128)
    err = d / "engine.stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kascade_cli.main", "--log-format", "json", "-vv", "engine",
                                 "serve", "--checkpoint", str(ckpt), "--empty", "--port", "0"],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**os.environ, "KASCADE_ENGINE_TOKEN": "t"})
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    port = None
    while time.monotonic() < deadline and port is None:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"engine exited {proc.wait()}: {err.read_text()[-2000:]}")
        if line.startswith("KASCADE_ENGINE_READY"):
            port = int(dict(p.split("=") for p in line.split()[1:])["http"])
    try:
        yield f"http://127.0.0.1:{port}", err
    finally:
        proc.terminate()
        proc.wait(10)


def probe(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kascade_cli.main", "probe", "models", *args],
                          capture_output=True, text=True, timeout=60)


def test_probe_passes_and_fails_against_a_real_engine_that_logs_json(json_engine: tuple[str, Path]) -> None:
    url, err = json_engine
    ok = probe(url, "--expect-model", "tiny-log")
    assert ok.returncode == 0 and "tiny-log" in ok.stdout, ok
    wrong = probe(url, "--expect-model", "other", "--timeout", "0.3", "--interval", "0.1")
    assert wrong.returncode == 1 and "tiny-log" in wrong.stderr and "other" in wrong.stderr, wrong
    down = probe("http://127.0.0.1:9", "--timeout", "0")
    assert down.returncode == 1 and "ConnectError" in down.stderr, down
    bad = probe("127.0.0.1:9")
    assert bad.returncode == 2 and "URL" in bad.stderr, bad
    lines = [x for x in err.read_text().splitlines() if x.strip()]
    assert lines, "the engine logged nothing at -vv"
    docs = [json.loads(x) for x in lines]  # every line is one JSON object
    assert {"ts", "level", "logger", "msg"} <= set(docs[0])


@pytest.mark.parametrize("argv", [
    ["operator", "run", "--engine-token", "t"],  # no cluster: one error line, exit 1
    ["router", "--backend", "m=127.0.0.1:9", "--host", "127.0.0.1", "--port", "0"],  # static backends, no cluster
], ids=["operator", "router"])
def test_operator_and_router_log_json_lines(argv: list[str], tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with err.open("w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "kascade_cli.main", "--log-format", "json", "-v", *argv],
                                stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                                env={**os.environ, "KUBECONFIG": str(tmp_path / "missing")})
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not err.read_text().strip():
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(15)
    lines = [x for x in err.read_text().splitlines() if x.strip()]
    assert lines, f"{argv[0]} logged nothing"
    docs = [json.loads(x) for x in lines]
    assert all({"ts", "level", "logger", "msg"} <= set(d) for d in docs), docs


def test_fallback_engine_pods_log_like_the_installation(monkeypatch: pytest.MonkeyPatch, restore_root: None) -> None:
    """logFormat reaches the pods the operator creates itself: chart -> operator env -> settings ->
    fallback pod env -> the engine's root option."""
    import yaml

    from kascade_devcluster.binaries import MissingBinaries, bin_dir
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod
    from kascade_operator.settings import OperatorSettings

    try:
        helm = bin_dir() / "helm"
    except MissingBinaries as e:
        pytest.skip(str(e))
    chart = Path(__file__).resolve().parents[2] / "charts" / "kascade"
    out = subprocess.run([str(helm), "template", "r", str(chart), "--set", "logFormat=json"],
                         capture_output=True, text=True, check=True).stdout
    op = next(
        d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment" and d["metadata"]["name"] == "r-operator"
    )
    env = {e["name"]: e["value"] for e in op["spec"]["template"]["spec"]["containers"][0]["env"] if "value" in e}
    assert env["KASCADE_OPERATOR_ENGINE_LOG_FORMAT"] == "json"
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_LOG_FORMAT", env["KASCADE_OPERATOR_ENGINE_LOG_FORMAT"])
    settings = OperatorSettings()
    assert settings.engine_log_format == "json"
    spec = ModelServiceSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "hf://o/m"}},
            "engine": {"image": "img:1"},
            "mode": "colocated",
            "replicas": {"colocated": {"min": 1, "max": 2}},
        }
    )
    pod = fallback_pod(spec, "svc", "tok", None, log_format=settings.engine_log_format)
    for c in pod["spec"]["containers"] + pod["spec"]["initContainers"]:  # the engine and its download
        pod_env = {e["name"]: e.get("value") for e in c["env"]}
        assert pod_env["KASCADE_LOG_FORMAT"] == "json", c["name"]
        assert not any(a.startswith("--log-format") for a in c["args"])  # the env decides at start-up
        r = CliRunner().invoke(cli, ["version"], env={"KASCADE_LOG_FORMAT": pod_env["KASCADE_LOG_FORMAT"]})
        assert r.exit_code == 0
        handler = next(h for h in logging.getLogger().handlers if type(h).__name__ == "_StderrHandler")
        assert isinstance(handler.formatter, logsetup.JsonFormatter)
        logsetup.configure(logging.INFO, "text")
    monkeypatch.setenv("KASCADE_OPERATOR_ENGINE_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match="engine_log_format"):
        OperatorSettings()


def test_named_loggers_at_debug_by_environment_and_httpx_requests_only_at_debug(
        restore_root: None, monkeypatch: pytest.MonkeyPatch) -> None:
    trace, httpx_log = logging.getLogger("kascade_test.trace"), logging.getLogger("httpx")
    levels = trace.level, httpx_log.level
    try:
        monkeypatch.setenv(logsetup.DEBUG_LOGGERS_ENV, "kascade_test.trace, ")
        buf = io.StringIO()
        logsetup.configure(logging.INFO, "text", stream=buf)
        trace.debug("trace start ns/svc 1.0")
        logging.getLogger("kascade_test.other").debug("not shown")
        httpx_log.info("HTTP Request: GET http://e/metrics")  # one per scrape at -v: not shown
        assert "trace start ns/svc" in buf.getvalue()
        assert "not shown" not in buf.getvalue() and "HTTP Request" not in buf.getvalue()
        monkeypatch.delenv(logsetup.DEBUG_LOGGERS_ENV)
        logsetup.configure(logging.DEBUG, "text", stream=buf)  # -vv: httpx's lines again
        httpx_log.info("HTTP Request: GET http://e/status")
        assert "GET http://e/status" in buf.getvalue()
    finally:
        trace.setLevel(levels[0])
        httpx_log.setLevel(levels[1])
