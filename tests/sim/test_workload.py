"""Workload readers, windows, rate scaling and the burst generator; bad rows name file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from kascade_sim.workload import TraceError, load, read_azure, read_burstgpt, synthetic_bursts

DATA = Path(__file__).parent / "data"


def test_azure_reader_rebases_time_and_keeps_lengths() -> None:
    wl = read_azure(DATA / "azure_code_head300.csv")
    assert len(wl.requests) == 300
    assert wl.requests[0].arrival_s == 0.0
    assert (wl.requests[0].input_tokens, wl.requests[0].output_tokens) == (4808, 10)
    # second row is 52 ms after the first (7 fractional digits parsed exactly enough)
    assert wl.requests[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(wl.requests, wl.requests[1:], strict=False))
    assert wl.duration_s == pytest.approx(216.838, abs=1e-3)


def test_burstgpt_reader_and_model_filter() -> None:
    wl = read_burstgpt(DATA / "burstgpt_small.csv")
    assert [r.input_tokens for r in wl.requests] == [472, 1087, 417, 100]
    assert wl.requests[3].output_tokens == 1  # zero-token responses still produce one token
    assert [r.arrival_s for r in read_burstgpt(DATA / "burstgpt_small.csv", model="GPT-4").requests] == [0.0]
    assert len(load(str(DATA / "burstgpt_small.csv")).requests) == 4


@pytest.mark.parametrize(("row", "field"), [
    ("2023-11-16 18:17:04.0319600,abc,8", "ContextTokens"),
    ("2023-11-16 18:17:04.0319600,10,-3", "GeneratedTokens"),
    ("16/11/2023 18:17,10,3", "TIMESTAMP"),
    ("2023-11-16 18:17:04.0319600,10", "3 fields"),
])
def test_azure_bad_row_names_file_and_line(tmp_path: Path, row: str, field: str) -> None:
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        read_azure(p)
    assert f"{p}:3" in str(e.value) and field in str(e.value)


def test_burstgpt_bad_rows(tmp_path: Path) -> None:
    p = tmp_path / "b.csv"
    p.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,1,1,2,x\nnow,ChatGPT,1,1,2,x\n")
    with pytest.raises(TraceError, match=rf"{p}:3: field 'Timestamp'"):
        read_burstgpt(p)
    p.write_text("Time,Model\n")
    with pytest.raises(TraceError, match=rf"{p}:1: expected header"):
        read_burstgpt(p)


def test_window_and_rate_scaling_preserve_the_pattern() -> None:
    wl = synthetic_bursts(200, base_rps=2, burst_rps=20, burst_every_s=50, burst_len_s=10, seed=3)
    w = wl.window(50, 100)
    assert all(0 <= r.arrival_s < 100 for r in w.requests)
    assert len(w.requests) == sum(1 for r in wl.requests if 50 <= r.arrival_s < 150)
    s = w.scale_rate(2.0)
    assert len(s.requests) == pytest.approx(2 * len(w.requests), rel=0.02)
    assert s.duration_s <= w.duration_s + 1e-9
    # Bursts at 0-10 and 50-60 in the window: the scaled trace keeps bursts at 0-5, 25-30, 50-55, 75-80.
    series = s.rate_series(5.0)
    burst = [series[i] for i in (0, 5, 10, 15)]
    calm = [series[i] for i in (2, 7, 12, 17)]
    assert min(burst) > 3 * max(calm)
    with pytest.raises(TraceError, match="rate scale factor"):
        w.scale_rate(0)


def test_synthetic_bursts_are_seeded() -> None:
    a = synthetic_bursts(60, 1, 10, 30, 5, seed=7)
    assert a == synthetic_bursts(60, 1, 10, 30, 5, seed=7)
    assert a != synthetic_bursts(60, 1, 10, 30, 5, seed=8)
