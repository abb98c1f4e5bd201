"""load-plan when things go wrong, on real engine processes: a source whose only downstream is killed
mid-transfer finishes that plan and accepts the next one on the same data port; engines started with
mutual TLS load by plan and answer like their source; a target whose certificate the source's CA did not
sign gets nothing and says why; bad TLS flags are one-line usage errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.ports import free_ports
from kascade_planner.baselines import build_star
from kascade_planner.plan import Instance, ModelLayout

pytestmark = pytest.mark.slow
BODY = {"model": "tiny-llama", "prompt": [7, 8, 9], "max_tokens": 6}


def _h(e: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {e.token}"}


def _plan(tiny_blocks: Any, src: str, dst: str, ps: int, pd: int, timeout_s: float) -> dict[str, Any]:
    layout = ModelLayout("tiny-llama", tiny_blocks.ids, tuple(b.nbytes for b in tiny_blocks.blocks.values()))
    plan = build_star(layout, [Instance(src, "n0")], [Instance(dst, "n1")]).to_dict()
    return {"plan": plan, "peers": {src: f"127.0.0.1:{ps}", dst: f"127.0.0.1:{pd}"}, "planToken": f"pt-{dst}",
            "timeoutSeconds": timeout_s}


def _status(e: Any) -> dict[str, Any]:
    return httpx.get(e.url + "/kascade/v1/status", headers=_h(e), timeout=30, verify=e.verify).json()


def _failures(e: Any) -> float:
    text = httpx.get(e.url + "/metrics", timeout=30, verify=e.verify).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("kascade_weight_transfer_failures_total "))


def _wait(cond: Any, what: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def _load(src: Any, dst: Any, doc: dict[str, Any], manifest: dict[str, Any], src_id: str, dst_id: str) -> None:
    r = httpx.post(
        dst.url + "/kascade/v1/load-plan",
        json={**doc, "self": dst_id, "manifest": manifest},
        headers=_h(dst),
        verify=dst.verify,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": src_id}, headers=_h(src), verify=src.verify)
    assert r.status_code == 200, r.text


def test_source_whose_only_downstream_dies_accepts_the_next_plan(tiny_ckpt: Path, tiny_blocks: Any,
                                                                 engine_starter: Any) -> None:
    # The source sends at 1 Mbit/s so the kill lands mid-transfer (the tiny model is ~1 MB: ~8 s in all).
    src = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--transfer-max-mbps", "1"])
    doomed = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
    later = None
    try:
        pa, pb, pc = free_ports(3)
        _load(src, doomed, _plan(tiny_blocks, "a", "b", pa, pb, 2.0), tiny_blocks.manifest(), "a", "b")
        _wait(lambda: _status(doomed)["bytesReceived"] > 0, "the first bytes at the doomed target")
        doomed.proc.send_signal(signal.SIGKILL)
        doomed.proc.wait(30)
        got = _status(src)
        assert got["phase"] == "serving" and not got["loadError"], got
        # The old plan must end (its downstream dropped) and free the data port: until then a new plan is 409.
        later = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty"])
        doc = _plan(tiny_blocks, "a", "c", pa, pc, 10.0)  # the same data port for the source
        r = httpx.post(
            later.url + "/kascade/v1/load-plan",
            json={**doc, "self": "c", "manifest": tiny_blocks.manifest()},
            headers=_h(later),
        )
        assert r.status_code == 200, r.text

        def accepted() -> bool:
            r = httpx.post(src.url + "/kascade/v1/load-plan", json={**doc, "self": "a"}, headers=_h(src))
            assert r.status_code in (200, 409), r.text
            return r.status_code == 200

        _wait(accepted, "the source to accept the next plan (it stays 409 while the old one never ends)", timeout=60)
        st = _wait(lambda: (s := _status(later))["ready"] and s, "the next target to load", timeout=120)
        assert all(st["blocks"].values()) and st["bytesReceived"] == tiny_blocks.total_bytes, st
        want = httpx.post(src.url + "/v1/completions", json=BODY).json()["choices"][0]["text"]
        assert httpx.post(later.url + "/v1/completions", json=BODY).json()["choices"][0]["text"] == want
    finally:
        for e in (src, doomed, later):
            if e is not None:
                e.stop()


def test_engines_with_mutual_tls_load_by_plan_and_refuse_a_foreign_certificate(
        tiny_ckpt: Path, tiny_blocks: Any, engine_starter: Any, tmp_path: Path) -> None:
    from kascade_devcluster.peercerts import make_peer_certs

    pki = make_peer_certs(tmp_path / "pki")
    tls = ["--tls-cert", str(pki["cert"]), "--tls-key", str(pki["key"]), "--tls-ca", str(pki["ca"])]
    foreign = ["--tls-cert", str(pki["rogue_cert"]), "--tls-key", str(pki["rogue_key"]), "--tls-ca", str(pki["ca"])]
    src = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", *tls])
    dst = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", *tls])
    intruder = engine_starter(["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--empty", *foreign])
    intruder.tls_ca = pki["rogue_ca"]  # its HTTP port serves HTTPS with its own (rogue) certificate
    try:
        pa, pb, pc = free_ports(3)
        _load(src, dst, _plan(tiny_blocks, "a", "b", pa, pb, 5.0), tiny_blocks.manifest(), "a", "b")
        st = _wait(lambda: (s := _status(dst))["ready"] and s, "the TLS target to load")
        assert st["bytesReceived"] == tiny_blocks.total_bytes
        want = httpx.post(src.url + "/v1/completions", json=BODY, verify=src.verify).json()["choices"][0]["text"]
        assert (
            httpx.post(dst.url + "/v1/completions", json=BODY, verify=dst.verify).json()["choices"][0]["text"] == want
        )
        # Same plan token, same plan, but a certificate from another CA: the source never serves it a byte,
        # and the intruder's load ends in an error that says no fallback could provide the blocks.
        _wait(
            lambda: (
                httpx.post(
                    src.url + "/kascade/v1/load-plan",
                    json={**_plan(tiny_blocks, "a", "x", pa, pc, 2.0), "self": "a"},
                    headers=_h(src),
                    verify=src.verify,
                ).status_code
                == 200
            ),
            "the source to accept a second plan",
        )
        r = httpx.post(
            intruder.url + "/kascade/v1/load-plan",
            json={**_plan(tiny_blocks, "a", "x", pa, pc, 2.0), "self": "x", "manifest": tiny_blocks.manifest()},
            headers=_h(intruder),
            verify=intruder.verify,
        )
        assert r.status_code == 200, r.text
        st = _wait(lambda: (s := _status(intruder))["loadError"] and s, "the intruder's load error", timeout=60)
        assert "no fallback could provide" in st["loadError"] and st["bytesReceived"] == 0, st
        # the failed transfer is counted (the transfer-failure alert's input); the good load is not
        assert _failures(intruder) == 1.0 and _failures(dst) == 0.0
    finally:
        for e in (src, dst, intruder):
            e.stop()


def test_bad_tls_flags_are_usage_errors_naming_them(tiny_ckpt: Path, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--port", "0", "--checkpoint", str(tiny_ckpt)]
    env = {**os.environ, "KASCADE_ENGINE_TOKEN": "t"}
    r = subprocess.run(
        [*base, "--tls-cert", str(tmp_path / "c.pem")], capture_output=True, text=True, env=env, timeout=120
    )
    assert r.returncode == 2 and "missing --tls-key, --tls-ca" in r.stderr, r.stderr
    r = subprocess.run([*base, "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"), "--tls-ca",
                        str(tmp_path / "ca.pem")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "--tls-ca" in r.stderr and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_a_symlink_loop_in_the_checkpoint_is_a_one_line_error_naming_the_file(tiny_ckpt: Path, tmp_path: Path) -> None:
    import shutil

    ckpt = tmp_path / "looped"
    shutil.copytree(tiny_ckpt, ckpt)
    (ckpt / "a.safetensors").symlink_to("b.safetensors")
    (ckpt / "b.safetensors").symlink_to("a.safetensors")
    env = {**os.environ, "KASCADE_ENGINE_TOKEN": "t"}
    r = subprocess.run(
        [sys.executable, "-m", "kascade_cli.main", "engine", "serve", "--port", "0", "--checkpoint", str(ckpt)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "Too many levels of symbolic links" in r.stderr and ".safetensors" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
