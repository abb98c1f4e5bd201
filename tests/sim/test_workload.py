"""Workload readers, windows, rate scaling and the burst generator; bad rows name file and line."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kascade_sim.generators import burstgpt_like, synthetic_bursts
from kascade_sim.traces import load, read_azure, read_burstgpt
from kascade_sim.workload import TraceError

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
    p.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n1,ChatGPT,1,1,2,x\nnow,ChatGPT,1,1,2,x\n"
    )
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


HEAD = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BHEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


@pytest.mark.parametrize(("text", "where"), [
    (HEAD + "2023-11-16 18:17:03.5e3,10,3\n", ":2: field 'TIMESTAMP'"),  # was read as +500 s
    (HEAD + "2023-11-16 18:17:03.1,1000000000000000000,3\n", ":2: field 'ContextTokens' = 1000000000000000000 exceeds"),
    (HEAD + "2023-11-16 18:17:03.1,10,3\n3023-11-16 18:17:03.1,10,3\n", ":3: the trace spans more than 366 days"),
    (HEAD + "2023-11-16 18:17:03.1,10," + "7" * 200_000 + "\n", ":2: line longer than 4096 characters"),
    (BHEAD + "03.5e3,ChatGPT,1,1,2,x\n", ":2: field 'Timestamp' must be a plain decimal"),
    (BHEAD + "inf,ChatGPT,1,1,2,x\n", ":2: field 'Timestamp'"),
    (BHEAD + "1,ChatGPT,1,1,2,x\n1e12,ChatGPT,1,1,2,x\n", ":3: field 'Timestamp'"),
    (BHEAD + "1,ChatGPT,1,1,2,x\n99999999999,ChatGPT,1,1,2,x\n", ":3: the trace spans more than"),
])
def test_bad_traces_are_one_line_errors_naming_line_and_field(tmp_path: Path, text: str, where: str) -> None:
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(TraceError) as e:
        load(str(p))
    assert str(e.value).startswith(f"{p}{where}") and "\n" not in str(e.value)


def test_bom_is_skipped_and_non_utf8_is_named(tmp_path: Path) -> None:
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbf" + (HEAD + "2023-11-16 18:17:03.25,10,3\n").encode())
    assert load(str(p)).requests[0].input_tokens == 10
    p.write_bytes(HEAD.encode() + b"2023-11-16 18:17:03.25,1\xff0,3\n")
    with pytest.raises(TraceError, match=r":2: not UTF-8"):
        load(str(p))


def test_window_is_applied_while_streaming(tmp_path: Path) -> None:
    rows = "".join(f"{t},ChatGPT,{t + 1},5,6,x\n" for t in range(0, 1000))
    p = tmp_path / "b.csv"
    p.write_text(BHEAD + rows)
    wl = load(f"burstgpt:{p}", start_s=100, length_s=50)
    assert [r.input_tokens for r in wl.requests] == list(range(101, 151))
    assert wl.requests[0].arrival_s == 0.0 and wl.duration_s == 49.0
    fraction = read_azure(DATA / "azure_code_head300.csv", 0.0, 10.0)
    assert 0 < len(fraction.requests) < 300


def test_burstgpt_like_generator_is_seeded_bursty_and_heavy_tailed() -> None:
    from statistics import mean, median, pstdev

    a = burstgpt_like(3600, 2.0, models=2, seed=3)
    assert a == burstgpt_like(3600, 2.0, models=2, seed=3) and a != burstgpt_like(3600, 2.0, models=2, seed=4)
    assert a.models == 2
    one = [r for r in a.requests if r.model == 0]
    assert 0.7 * 7200 < len(one) < 1.3 * 7200  # 2 requests/s on average
    gaps = [y.arrival_s - x.arrival_s for x, y in itertools.pairwise(one)]
    assert pstdev(gaps) / mean(gaps) > 1.3  # burstier than Poisson (CV 1)
    per_min = [c for c in a.rate_series(60.0)]
    assert max(per_min) > 2 * median(per_min) > 20 * min(per_min) / 10  # minute-scale bursts
    ins = sorted(r.input_tokens for r in one)
    assert 600 < mean(ins) < 1500 and ins[len(ins) * 99 // 100] > 10 * median(ins)
    assert 150 < mean(r.output_tokens for r in one) < 450
    with pytest.raises(TraceError):
        burstgpt_like(60, 0.0)
