"""bench/gpu_smoke.py, whose real target (a GPU) is absent here: `--cpu-dry-run` runs the same code on CPU with
small sizes and must write every field with sane values (greedy equality, the engine's attention calls, step
times, upload rates, a two-engine load plan whose target holds every tensor on the device); without the flag
on a machine without CUDA it says so and exits 0 writing nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kascade_engine.weights.checkpoint import tiny_llama

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "bench" / "gpu_smoke.py"


def _weights(tmp_path: Path) -> int:
    """Tensors in the tiny Llama the script builds (same arguments)."""
    ckpt = tiny_llama(tmp_path / "tiny", layers=4, hidden=64, vocab=512)
    n = 0
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            n += len(list(st.keys()))
    return n


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~20 s alone; minutes on a loaded 2-core machine
def test_cpu_dry_run_writes_every_field_and_greedy_holds(tmp_path: Path) -> None:
    out = tmp_path / "gpu_smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["dry_run"] is True and doc["not_run_on_gpu_yet"] is True and doc["device"] == "cpu"
    g = doc["greedy"]["tiny-llama"]
    assert g["greedy_equal"] is True and g["greedy_equal_per_prompt"] == [True] * 4, g
    want = {"cpu": _weights(tmp_path) + 2}  # every weight tensor and the K and V caches
    assert g["tensor_devices"] == want and g["all_tensors_on_device"] is True, g
    att = doc["attention"]
    assert att["engine_sdpa_calls"] > 0 and att["engine_attention_device"] == "cpu", att
    assert att["backends_accepting_engine_calls"]["math"] is True  # math takes any call
    assert att["engine_backend_torch_would_pick"] in att["backends_accepting_engine_calls"]
    for b in (1, 4):
        assert doc["decode"][f"engine_step_ms_b{b}"] > 0 and doc["decode"][f"hf_step_ms_b{b}"] > 0, doc["decode"]
    up = doc["upload"]
    assert up["upload_gbps_pinned"] > 0 and up["upload_gbps_pageable"] > 0 and up["upload_device"] == "cpu", up
    lp = doc["load_plan"]
    assert lp["bytes"] == lp["expected_bytes"] > 0, lp
    assert lp["tensor_devices"] == want and lp["all_tensors_on_device"] is True, lp
    assert lp["answers_like_source"] is True, lp


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present: the script measures instead")
def test_without_cuda_it_says_so_and_exits_zero(tmp_path: Path) -> None:
    out = tmp_path / "gpu_smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device here" in proc.stdout and not out.exists()
