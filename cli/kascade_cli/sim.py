"""`kascade sim TRACE`: replay a workload trace on a simulated cluster under several systems and
compare TTFT/TBT, SLO attainment and GPU time (JSON result + PNG plot)."""

from __future__ import annotations

import json
from pathlib import Path

import click

SYSTEMS = ("kascade", "serverlessllm", "allcache", "lambdascale", "static-peak", "static-average")


@click.command()
@click.argument("trace")
@click.option("-s", "--system", "systems", multiple=True, type=click.Choice(SYSTEMS), help="Default: all.")
@click.option("--hardware", "hw_name", default="a800", show_default=True, help="a800 | a100 | infinite")
@click.option("--hosts", type=click.IntRange(1, 4096), default=4, show_default=True)
@click.option("--gpus-per-host", type=click.IntRange(1, 64), default=8, show_default=True)
@click.option("--model", "model_name", default="llama3-8b", show_default=True, help="llama3-8b | mistral-24b")
@click.option("--start", type=click.FloatRange(0), default=0.0, help="Window start (s).")
@click.option("--duration", type=click.FloatRange(0, min_open=True), help="Window length (s); default: whole trace.")
@click.option("--rate-scale", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True)
@click.option("--upper", type=click.FloatRange(0, min_open=True), default=6000.0, show_default=True,
              help="Threshold policy: tokens/s per instance that triggers a scale-up.")
@click.option("--lower", type=click.FloatRange(0), default=2000.0, show_default=True)
@click.option("--scale-down-delay", type=click.FloatRange(0), default=5.0, show_default=True)
@click.option("--mode", type=click.Choice(["colocated", "disaggregated"]), default="colocated", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("sim-result.json"), show_default=True)
@click.option("--per-request", is_flag=True, help="Include every request's arrival, TTFT and TBT in the JSON.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG plot here.")
def sim(trace: str, systems: tuple[str, ...], hw_name: str, hosts: int, gpus_per_host: int, model_name: str,
        start: float, duration: float | None, rate_scale: float, upper: float, lower: float,
        scale_down_delay: float, mode: str, seed: int, out: Path, per_request: bool, plot_path: Path | None) -> None:
    """Simulate TRACE (`azure:PATH`, `burstgpt:PATH` or a CSV path) on a cluster."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kascade_planner.policies import Threshold
    from kascade_sim.compare import comparison
    from kascade_sim.hardware import hardware, model
    from kascade_sim.simulator import SimConfig, Simulation
    from kascade_sim.systems import system
    from kascade_sim.traces import load
    from kascade_sim.workload import TraceError

    try:
        wl = load(trace)
        if duration is not None or start:
            wl = wl.window(start, duration if duration is not None else wl.duration_s + 1 - start)
        if rate_scale != 1.0:
            wl = wl.scale_rate(rate_scale)
        hw = hardware(hw_name, hosts=hosts, gpus_per_host=gpus_per_host)
        spec = model(model_name)
        cfg = SimConfig(policy=Threshold(upper, lower, scale_down_delay), seed=seed, mode=mode)
    except (TraceError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not wl.requests:
        raise click.ClickException(f"no requests in {wl.name}")
    import time

    results = []
    t0 = time.perf_counter()
    with Progress() as bar:
        for name in systems or SYSTEMS:
            task = bar.add_task(f"{name:15s}", total=wl.duration_s)
            results.append(Simulation(wl, hw, spec, system(name), cfg,
                                      lambda t, task=task: bar.update(task, completed=min(t, wl.duration_s))).run())
            bar.update(task, completed=wl.duration_s)
    doc = comparison(results, time.perf_counter() - t0)
    doc["workload"] = wl.name
    doc["results"] = {r.system: r.to_dict(per_request) for r in results}
    out.write_text(json.dumps(doc, indent=1, default=float))
    table = Table(title=f"{wl.name}: {len(wl.requests)} requests on {hw.hosts}x{hw.gpus_per_host} {hw.name}")
    for col in ("system", "TTFT mean", "p50", "p99", "TBT p99", "SLO 5x", "GPU-s", "host cache GB", "scale-ups"):
        table.add_column(col)
    for name, s in doc["systems"].items():
        table.add_row(name, f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p99_s']:.3f}",
                      f"{s['tbt_p99_s']:.4f}", f"{s['slo_attainment_5x']:.1%}", f"{s['gpu_seconds']:.0f}",
                      f"{s['host_cache_bytes_peak'] / 1e9:.0f}", str(s["scale_ups"]))
    console = Console()
    console.print(table)
    console.print(f"wrote {out} ({doc['sim_requests_per_s']:.0f} simulated requests/s)")
    if plot_path is not None:
        from kascade_sim.plots import plot

        console.print(f"wrote {plot(results, plot_path)}")
