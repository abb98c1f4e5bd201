"""`kascade sim`: writes a JSON comparison and a PNG; bad traces and flags give clear errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kascade_cli.sim import sim

DATA = Path(__file__).parent / "data"


def test_sim_writes_json_and_plot(tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    res = CliRunner().invoke(sim, [f"azure:{DATA / 'azure_code_head300.csv'}", "-s", "kascade", "-s", "serverlessllm",
                                   "--rate-scale", "4", "--hosts", "4", "--gpus-per-host", "4",
                                   "-o", str(out), "--plot", str(png), "--per-request"])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert set(doc["systems"]) == {"kascade", "serverlessllm"}
    assert doc["systems"]["kascade"]["requests"] == 1200
    assert doc["ttft_mean_reduction_vs_sllm"] > 0
    reqs = doc["results"]["kascade"]["requests"]
    assert len(reqs) == 1200 and all(r["ttft_s"] > 0 for r in reqs)
    assert doc["results"]["kascade"]["ttft_cdf"][-1][1] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_bad_trace_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,ten\n")
    res = CliRunner().invoke(sim, [f"azure:{bad}", "-o", str(tmp_path / "r.json")])
    assert res.exit_code != 0
    assert f"{bad}:2" in res.output and "GeneratedTokens" in res.output


def test_sim_bad_hardware_preset(tmp_path: Path) -> None:
    res = CliRunner().invoke(sim, [str(DATA / "burstgpt_small.csv"), "--hardware", "h900"])
    assert res.exit_code != 0 and "h900" in res.output


def test_sim_burstgpt_like_with_paper_flags(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    res = CliRunner().invoke(sim, ["burstgpt-like", "--rate", "2", "--duration", "60", "--models", "2", "--seed", "3",
                                   "-s", "kascade", "-s", "serverlessllm", "--rdma-gbps", "200", "--host-mem-gb", "40",
                                   "--keep-alive", "10", "--scale-down-delay", "0.5", "--tick", "0.25",
                                   "--hosts", "2", "--gpus-per-host", "4", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["systems"]["kascade"]["models"] == 2 and doc["workload"].startswith("burstgpt-like")


def _disaggregated(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    """One `kascade sim burstgpt-like --mode disaggregated` run of Kascade alone; its JSON document."""
    out = tmp_path / f"{name}.json"
    res = CliRunner().invoke(sim, ["burstgpt-like", "--duration", "60", "--seed", "1", "-s", "kascade",
                                   "--mode", "disaggregated", *flags, "-o", str(out)])
    assert res.exit_code == 0, res.output
    return dict(json.loads(out.read_text()))


def test_sim_convertible_flags(tmp_path: Path) -> None:
    """--no-convertible turns Kascade's convertible decoders off (disaggregated mode): no decoder prefills."""
    got = {
        flag: _disaggregated(tmp_path, flag, "--rate", "1", "--min-instances", "0", "--hosts", "1",
                             "--gpus-per-host", "4", flag, "--convert-chunk-tokens", "128")
        ["systems"]["kascade"]["converted_prefills"]
        for flag in ("--convertible", "--no-convertible")
    }
    assert got["--convertible"] > 0 and got["--no-convertible"] == 0, got


def test_sim_pd_policy_token_velocity(tmp_path: Path) -> None:
    """--pd-policy tokenVelocity: the disaggregated scale events are the operator's P:D ratio policy's."""
    reasons = {
        pol: [e["reason"] for e in _disaggregated(tmp_path, pol, "--rate", "4", "--hosts", "1", "--gpus-per-host",
                                                  "8", "--pd-policy", pol)["results"]["kascade"]["events"]]
        for pol in ("threshold", "tokenVelocity")
    }
    assert reasons["tokenVelocity"] and all(r.startswith("P:D ratio") for r in reasons["tokenVelocity"]), reasons
    assert not any(r.startswith("P:D ratio") for r in reasons["threshold"])


@pytest.mark.parametrize(("flags", "named"), [
    (["--rdma-gbps", "0"], "--rdma-gbps"),
    (["--ssd-gbps", "-1"], "--ssd-gbps"),
    (["--tp", "0"], "--tp"),
    (["--models", "0"], "--models"),
    (["--keep-alive", "-5"], "--keep-alive"),
    (["--rate-scale", "1e9"], "--rate-scale"),
    (["--upper", "1", "--lower", "2"], "lower"),
    (["--model", "qwen-72b", "--tp", "1"], "does not fit"),
    (["--model", "gpt-9"], "gpt-9"),
    (["--max-instances", "0"], "--max-instances"),
    (["--convert-chunk-tokens", "0"], "--convert-chunk-tokens"),
    (["--pd-policy", "ratio"], "--pd-policy"),
])
def test_sim_bad_flags_are_clear_errors(tmp_path: Path, flags: list[str], named: str) -> None:
    res = CliRunner().invoke(sim, [str(DATA / "burstgpt_small.csv"), "-o", str(tmp_path / "r.json"), *flags])
    assert res.exit_code != 0 and named in res.output and "Traceback" not in res.output


def test_sim_fleet_prints_what_is_simulated_and_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    res = CliRunner().invoke(sim, [f"azure:{DATA / 'azure_code_head300.csv'}", "--models", "2", "--zipf", "1",
                                   "--rate-scale", "2", "--hosts", "2", "--gpus-per-host", "2", "--min-instances", "0",
                                   "--fleet", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "what is simulated" in res.output and "fleet_gpu_time_over_per_model_pools" in res.output
    doc = json.loads(out.read_text())
    assert doc["models"] == 2 and doc["workload"].endswith("zipf1x2")
    assert set(doc["runs"]) >= {"kascade-fleet", "kascade-per-model-pools", "serverlessllm-fleet", "allcache-fleet"}
    assert doc["fleet_gpu_time_over_per_model_pools"] > 0
    res = CliRunner().invoke(sim, [f"azure:{DATA / 'azure_code_head300.csv'}", "--fleet", "-o", str(out)])
    assert res.exit_code != 0 and "at least 2 models" in res.output
