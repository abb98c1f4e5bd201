"""`kascade sim TRACE`: replay a workload trace on a simulated cluster under several systems and
compare TTFT/TBT, SLO attainment and GPU time (JSON result + PNG plot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import TaskID

if TYPE_CHECKING:
    from kascade_sim.hardware import Hardware, ModelSpec
    from kascade_sim.simulator import SimConfig
    from kascade_sim.workload import Workload

SYSTEMS = ("kascade", "kascade-noconv", "serverlessllm", "allcache", "lambdascale", "static-peak", "static-average")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "kascade-noconv")


POS = click.FloatRange(0, min_open=True, max=1e12)


@click.command()
@click.argument("trace")
@click.option("-s", "--system", "systems", multiple=True, type=click.Choice(SYSTEMS), help="Default: all.")
@click.option("--hardware", "hw_name", default="a800", show_default=True,
              help="a800 / cluster-a | a100 / cluster-b | infinite")
@click.option("--hosts", type=click.IntRange(1, 4096), help="Default: the preset's.")
@click.option("--gpus-per-host", type=click.IntRange(1, 64), help="Default: the preset's.")
@click.option("--rdma-gbps", type=POS, help="Scale-out bandwidth per GPU.")
@click.option("--pcie-gbps", type=POS, help="Host memory -> GPU per GPU.")
@click.option("--ssd-gbps", type=POS, help="Local SSD -> GPU per GPU.")
@click.option("--nvlink-gbps", type=POS, help="GPU <-> GPU inside a host.")
@click.option("--host-mem-gb", type=POS, help="Host DRAM per host for cached model copies (default: unlimited).")
@click.option(
    "--model", "model_name", default="llama3-8b", show_default=True, help="llama3-8b | mistral-24b | qwen-72b"
)
@click.option("--tp", type=click.IntRange(1, 64), help="GPUs per instance (default: the model preset's).")
@click.option("--models", "n_models", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Models sharing the cluster; a trace is replayed for each, shifted in time. Colocated, the "
                   "planner's arbitration decides who gets GPUs (docs/fleet.md).")
@click.option("--rate", type=click.FloatRange(0, min_open=True, max=1e5), default=1.0, show_default=True,
              help="burstgpt-like: mean requests/s per model.")
@click.option("--start", type=click.FloatRange(0, max=1e9), default=0.0, help="Window start (s).")
@click.option("--duration", type=click.FloatRange(0, min_open=True, max=1e9),
              help="Window length (s); default: whole trace (burstgpt-like: 600 s).")
@click.option("--rate-scale", type=click.FloatRange(0, min_open=True, max=1000), default=1.0, show_default=True)
@click.option("--thin", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
              help="Keep each request with this probability (seeded by --seed): a lower rate with the trace's own "
                   "timing, unlike --rate-scale, which compresses time.")
@click.option("--keep-alive", type=click.FloatRange(0, max=1e7), help="ServerlessLLM host-cache keep-alive (s).")
@click.option("--policy", type=click.Choice(["queue", "tokens"]), default="queue", show_default=True,
              help="queue: BlitzScale (queue length + busy instances; decode on KV usage); tokens: tokens/s.")
@click.option(
    "--upper", type=click.FloatRange(0, min_open=True, max=1e9), help="Scale-up bound (queue: 4, tokens: 6000)."
)
@click.option("--lower", type=click.FloatRange(0, max=1e9), help="Scale-down bound (queue: 0.3, tokens: 2000).")
@click.option("--scale-down-delay", type=click.FloatRange(0, max=3600), default=5.0, show_default=True,
              help="Seconds below the lower bound before scaling down (sub-second allowed).")
@click.option("--tick", type=click.FloatRange(0.01, 60), default=0.5, show_default=True, help="Policy period (s).")
@click.option("--min-instances", type=click.IntRange(0, 4096), default=1, show_default=True, help="Per model and role.")
@click.option("--max-instances", type=click.IntRange(1, 4096), help="Per model and role.")
@click.option("--mode", type=click.Choice(["colocated", "disaggregated"]), default="colocated", show_default=True)
@click.option("--convertible/--no-convertible", default=True, show_default=True,
              help="Kascade's convertible decoders (disaggregated mode): the operator's conversion policy converts "
                   "decoders while prompt tokens/s exceed the prefillers' velocity; a converted one prefills when no "
                   "prefiller is idle.")
@click.option("--convert-chunk-tokens", type=click.IntRange(1, 1_000_000),
              help="Prompt tokens per converted prefill step while the decoder has running requests "
                   "(default: the conversion policy's budget from the TBT SLO and the prefill velocity).")
@click.option("--pd-policy", type=click.Choice(["threshold", "tokenVelocity"]), default="threshold", show_default=True,
              help="Disaggregated mode: threshold per role, or both counts from the operator's P:D ratio policy.")
@click.option("--zipf", type=click.FloatRange(0, 8), default=0.0, show_default=True,
              help="With --models: model k keeps each request with probability (k+1)^-zipf (Zipf popularity, as "
                   "lambdaScale maps Azure Functions to models); 0: every model sees the whole trace.")
@click.option("--fleet", is_flag=True,
              help="Compare one shared fleet (the planner's arbitration across models) with per-model pools, and "
                   "ServerlessLLM and AllCache on the fleet: GPU time, mean and p99 TTFT (colocated, --models >= 2).")
@click.option("--seed", type=click.IntRange(0, 2**31), default=0, show_default=True)
@click.option("-o", "--out", type=click.Path(path_type=Path), default=Path("sim-result.json"), show_default=True)
@click.option("--per-request", is_flag=True, help="Include every request's arrival, TTFT and TBT in the JSON.")
@click.option("--plot", "plot_path", type=click.Path(path_type=Path), help="Write a PNG plot here.")
def sim(
    trace: str,
    systems: tuple[str, ...],
    hw_name: str,
    hosts: int | None,
    gpus_per_host: int | None,
    rdma_gbps: float | None,
    pcie_gbps: float | None,
    ssd_gbps: float | None,
    nvlink_gbps: float | None,
    host_mem_gb: float | None,
    model_name: str,
    tp: int | None,
    n_models: int,
    rate: float,
    start: float,
    duration: float | None,
    rate_scale: float,
    thin: float,
    keep_alive: float | None,
    policy: str,
    upper: float | None,
    lower: float | None,
    scale_down_delay: float,
    tick: float,
    min_instances: int,
    max_instances: int | None,
    mode: str,
    convertible: bool,
    convert_chunk_tokens: int | None,
    pd_policy: str,
    zipf: float,
    fleet: bool,
    seed: int,
    out: Path,
    per_request: bool,
    plot_path: Path | None,
) -> None:
    """Simulate TRACE (`azure:PATH`, `burstgpt:PATH`, a CSV path, or `burstgpt-like` for the seeded
    BurstGPT-like generator) on a cluster."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kascade_planner.policies import Threshold
    from kascade_sim.compare import comparison
    from kascade_sim.generators import burstgpt_like
    from kascade_sim.hardware import hardware, model
    from kascade_sim.simulator import SimConfig, Simulation, SimulationStalled
    from kascade_sim.systems import system
    from kascade_sim.traces import load
    from kascade_sim.workload import TraceError

    links = {"hosts": hosts, "gpus_per_host": gpus_per_host, "rdma_gbps": rdma_gbps, "pcie_gbps": pcie_gbps,
             "ssd_gbps": ssd_gbps, "nvlink_gbps": nvlink_gbps, "host_mem_gb": host_mem_gb}
    try:
        if trace == "burstgpt-like":
            wl = burstgpt_like(duration or 600.0, rate, models=n_models, seed=seed)
        else:
            base = load(trace, start, duration)
            wl = base.for_models_zipf(n_models, zipf, seed) if zipf and n_models > 1 else base.for_models(n_models)
        if rate_scale != 1.0:
            wl = wl.scale_rate(rate_scale)
        if thin != 1.0:
            wl = wl.thin(thin, seed)
            if not wl.requests:
                raise click.ClickException(f"--thin {thin} kept no request")
        hw = hardware(hw_name, **{k: v for k, v in links.items() if v is not None})
        spec = model(model_name, tp)
        metric = "queueLength" if policy == "queue" else "tokensPerSecond"
        up = upper if upper is not None else (4.0 if policy == "queue" else 6000.0)
        lo = lower if lower is not None else (0.3 if policy == "queue" else 2000.0)
        cfg = SimConfig(policy=Threshold(up, lo, scale_down_delay, metric), tick_s=tick, min_instances=min_instances,
                        max_instances=max_instances, seed=seed, mode=mode, pd_policy=pd_policy)
        sys_overrides = {"keep_alive_s": keep_alive} if keep_alive is not None else {}
        kascade = {"convertible": convertible, "convert_chunk_tokens": convert_chunk_tokens}
        chosen = [system(n, **sys_overrides) if n == "serverlessllm" else system(n, **kascade) if n == "kascade"
                  else system(n) for n in systems or DEFAULT_SYSTEMS]
        spec.kv_capacity_tokens(hw)  # the model must fit its GPUs
    except (TraceError, ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not wl.requests:
        raise click.ClickException(f"no requests in {wl.name}")
    if fleet:
        _fleet(wl, hw, spec, cfg, out)
        return
    import time

    results = []
    t0 = time.perf_counter()
    try:
        with Progress() as bar:
            for chosen_sys in chosen:
                task = bar.add_task(f"{chosen_sys.name:15s}", total=wl.duration_s)

                def tick_cb(t: float, task: TaskID = task) -> None:
                    bar.update(task, completed=min(t, wl.duration_s))

                results.append(Simulation(wl, hw, spec, chosen_sys, cfg, tick_cb).run())
                bar.update(task, completed=wl.duration_s)
    except (ValueError, SimulationStalled) as e:
        raise click.ClickException(str(e)) from None
    doc = comparison(results, time.perf_counter() - t0)
    doc["workload"] = wl.name
    doc["results"] = {r.system: r.to_dict(per_request) for r in results}
    out.write_text(json.dumps(doc, indent=1, default=float))
    table = Table(
        title=f"{wl.name}: {len(wl.requests)} requests, {wl.models} model(s) on {hw.hosts}x{hw.gpus_per_host} {hw.name}"
    )
    for col in ("system", "TTFT mean", "p50", "p99", "TBT p99", "SLO 5x", "GPU-s", "host cache GB", "scale-ups"):
        table.add_column(col)
    for name, s in doc["systems"].items():
        table.add_row(
            name,
            f"{s['ttft_mean_s']:.3f}",
            f"{s['ttft_p50_s']:.3f}",
            f"{s['ttft_p99_s']:.3f}",
            f"{s['tbt_p99_s']:.4f}",
            f"{s['slo_attainment_5x']:.1%}",
            f"{s['gpu_seconds']:.0f}",
            f"{s['host_cache_bytes_peak'] / 1e9:.0f}",
            str(s["scale_ups"]),
        )
    console = Console()
    console.print(table)
    console.print(f"wrote {out} ({doc['sim_requests_per_s']:.0f} simulated requests/s)")
    if plot_path is not None:
        from kascade_sim.plots import plot

        console.print(f"wrote {plot(results, plot_path)}")


def _fleet(wl: Workload, hw: Hardware, spec: ModelSpec, cfg: SimConfig, out: Path) -> None:
    """`--fleet`: the shared fleet against per-model pools (kascade_sim.fleet)."""
    from rich.console import Console
    from rich.table import Table

    from kascade_sim.fleet import fleet_comparison

    try:
        doc = fleet_comparison(wl, hw, spec, cfg)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    out.write_text(json.dumps(doc, indent=1, default=float))
    table = Table(title=f"{wl.name}: {doc['requests']} requests, {doc['models']} models on {doc['cluster']} "
                        f"(equal pools: {doc['per_model_pool']} each)")
    for col in ("run", "pool GPU-s", "peak GPUs", "bound GPU-s", "TTFT mean", "TTFT p99", "preempted"):
        table.add_column(col)
    for name, r in doc["runs"].items():
        table.add_row(name, f"{r['pool_gpu_seconds']:.0f}", str(r["peak_gpus"]), f"{r['gpu_seconds']:.0f}",
                      f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p99_s']:.3f}", str(r["preemptions"]))
    console = Console()
    console.print(table)
    console.print(f"fleet_gpu_time_over_per_model_pools {doc['fleet_gpu_time_over_per_model_pools']:.3f} "
                  f"(bound GPU-s: {doc['fleet_bound_gpu_time_over_per_model_pools']:.3f})")
    console.print(f"what is simulated: {doc['simulated']}")
    console.print(f"wrote {out}")
