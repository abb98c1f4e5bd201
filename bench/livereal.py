"""The real-engine section of bench/live.py: stop-the-world against the live modes on real engine processes
and real weight transfers over tbf-linked namespaces (livelab.py runs the fleets), and the keys the issue asks
for: `real_p99_ttft_zigzag_over_stop` (and best effort, ZigZag ILP) from the pair fleet,
`mean_ttft_pipeline{2,4}_over_stop` from the pipeline fleets, `real_split_exact` (every request's text equal
across modes), TTFT per fleet and mode, and the setup.

Data flow: `add_args` (this section's options on live.py's parser) -> `real_section(args)`: a tiny Llama
checkpoint -> its blocks' layout -> link rate for `--load-s` per copy -> livelab.fleet per fleet (TTFT, text,
engine per request, per mode) -> the keys above (failed requests left out of the TTFTs, counted per mode).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from kascade_engine.weights.blocks import pack_checkpoint
from kascade_engine.weights.checkpoint import tiny_llama
from kascade_planner.plan import ModelLayout


def add_args(ap: argparse.ArgumentParser) -> None:
    """The real section's options."""
    ap.add_argument(
        "--rate-mbit", type=int, default=None, help="real section: link rate (default: the model in --load-s)"
    )
    ap.add_argument(
        "--load-s", type=float, default=6.0, help="real section: seconds to send the whole model over a link"
    )
    ap.add_argument(
        "--layer-ms", type=float, default=80.0, help="real section: emulated time of one layer forward per step"
    )
    ap.add_argument(
        "--knee-tokens",
        type=int,
        default=0,
        help="real section: a layer forward over more tokens than this costs proportionally more "
        "(compute-bound; 128 = one full batch). 0: every layer forward costs --layer-ms (memory-bound)",
    )
    ap.add_argument("--real-overload", type=float, default=2.0,
                    help="real section: arrival rate / the sources' measured capacity")
    ap.add_argument("--link-qos", action=argparse.BooleanOptionalAction, default=True,
                    help="real section: links that send the engines' activation class (DSCP AF41) ahead of weights "
                         "(netlab.py, QoS), as a fabric configured with the engine's traffic classes does "
                         "(docs/dataplane.md, Traffic classes): the default (pipe4 mean ratio 0.603 "
                         "over 8 runs against 0.650 over 7 on FIFO links, ADR 0007); "
                         "--no-link-qos: one FIFO (tbf) per link, as the benches were measured before")
    ap.add_argument(
        "--redirect",
        choices=("both", "sources", "off"),
        default="off",
        help="real section, pipelines: once the pipeline forms, queued requests move between the sources and "
        "its head both ways (kascade_engine.live.liveredirect), only from the sources to the head, or not at "
        "all (default: only new arrivals go to the pipeline, by the router's weights; both ways raised "
        "the pipe4 ratio by 0.04-0.05 in paired runs, ADR 0008)",
    )
    ap.add_argument("--no-redirect", action="store_const", const="off", dest="redirect", help="= --redirect off")
    ap.add_argument("--route", choices=("ttft", "share"), default="ttft",
                    help="real section: the driver's routing rule, every mode alike: the least expected time to first "
                         "token (kascade_router.firsttoken: each engine's measured first-token rate and latency; the "
                         "default) or the least (in flight + 1) / weight (the rule before; "
                         "ADR 0009)")
    ap.add_argument("--real-only", action="store_true", help="only the real-engine section (-> live_real.json)")
    ap.add_argument("--fleets", default="pair,pipe2,pipe4",
                    help="real section: which fleets to run (comma-separated subset of pair,pipe2,pipe4); a key whose "
                         "fleet did not run is not reported")


def real_section(args: argparse.Namespace) -> dict[str, object]:
    """Stop-the-world vs live modes on real engine processes and real weight transfers (livelab.py)."""
    import livelab
    import netlab

    why = netlab.available() if os.geteuid() == 0 else "needs root (ip netns, tc)"
    if why is not None:
        print(f"real-engine section SKIPPED: {why}")
        return {"real": f"skipped: {why}"}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = tiny_llama(Path(tmp) / "m", layers=args.layers, hidden=128, vocab=512)
        bs = pack_checkpoint(ckpt, "bench-llama")
        manifest = dict(bs.manifest())
        ids = tuple(manifest)
        layout = ModelLayout("bench-llama", ids, tuple(int(manifest[b]["bytes"]) for b in ids))
        total = sum(layout.block_bytes)
        rate = args.rate_mbit or max(1, round(total * 8 / args.load_s / 1e6))
        setup = livelab.Setup(rate, args.layer_ms, 128, 32, 4, args.real_overload, total * 8 / (rate * 1e6),
                              200 if args.quick else 400, args.knee_tokens, args.link_qos, args.redirect, args.route)
        knee = (
            f", x (tokens / {setup.knee_tokens}) past {setup.knee_tokens} tokens"
            if setup.knee_tokens
            else " (memory-bound: any tokens)"
        )
        print(
            f"real engines: {args.layers} layers, {total / 1e6:.1f} MB over {rate} Mbit/s links "
            f"({'activations first' if args.link_qos else 'one FIFO'}) "
            f"({setup.load_s:.1f} s per copy); compute emulated at {args.layer_ms} ms per layer forward per step"
            f"{knee}"
        )
        fleets = [f.strip() for f in args.fleets.split(",") if f.strip()]
        if not fleets or any(f not in ("pair", "pipe2", "pipe4") for f in fleets):
            raise SystemExit(f"--fleets: {args.fleets!r} must name some of pair, pipe2, pipe4")
        res: dict[str, dict[str, list[tuple[float, str, str]]]] = {}
        if "pair" in fleets:
            res["pair"] = livelab.fleet("pair", 1, ("stop-the-world", "best-effort", "zigzag", "zigzag-ilp"), ckpt,
                                        manifest, layout, setup, "k17a")
        for k in (2, 4):
            if f"pipe{k}" in fleets:
                res[f"pipe{k}"] = livelab.fleet("pipe", k, ("stop-the-world", "pipeline"), ckpt, manifest, layout,
                                                setup, f"k17p{k}")

    def ok(xs: list[tuple[float, str, str]]) -> list[float]:
        return [x[0] for x in xs if not x[2].startswith("failed:")]

    def p99(xs: list[tuple[float, str, str]]) -> float:
        return float(np.percentile(ok(xs), 99))

    def mean(xs: list[tuple[float, str, str]]) -> float:
        return float(np.mean(ok(xs)))

    exact = all(
        len({x[1] for x in col if not x[2].startswith("failed:")}) <= 1
        for f in res.values()
        for col in zip(*f.values(), strict=True)
    )
    out: dict[str, object] = {}
    if "pair" in res:
        pair = res["pair"]
        out["real_p99_ttft_zigzag_over_stop"] = p99(pair["zigzag"]) / p99(pair["stop-the-world"])
        out["real_p99_ttft_besteffort_over_stop"] = p99(pair["best-effort"]) / p99(pair["stop-the-world"])
        out["real_p99_ttft_zigzag_ilp_over_stop"] = p99(pair["zigzag-ilp"]) / p99(pair["stop-the-world"])
    for k in (2, 4):
        if f"pipe{k}" in res:
            out[f"mean_ttft_pipeline{k}_over_stop"] = mean(res[f"pipe{k}"]["pipeline"]) / mean(
                res[f"pipe{k}"]["stop-the-world"]
            )
    out.update(
        {
            "real_split_exact": exact,
            "real_fleets": sorted(res),
            "real_ttft_s": {
                f: {
                    m: {
                        "mean": mean(v),
                        "p99": p99(v),
                        "on_targets": sum(1 for x in v if x[2].startswith("t")),
                        "requests": len(v),
                        "failed": len(v) - len(ok(v)),
                    }
                    for m, v in modes.items()
                }
                for f, modes in res.items()
            },
            "real_setup": {
                "rate_mbit": setup.rate_mbit,
                "load_s": setup.load_s,
                "layer_ms": setup.layer_ms,
                "compute": "emulated per step (--emulate-layer-ms); transfers, activations and HTTP real",
                "knee_tokens": setup.knee_tokens,
                "links": "activation class (DSCP AF41) first, htb" if setup.link_qos else "one FIFO (tbf)",
                "stop_baseline_of_pipelines": "stop-the-world on the same fleet (k sources, k targets)",
                "pipeline_redirect": setup.redirect,
                "routing": setup.route,
            },
            # per request, in trace order: [TTFT s, engine that served it (or failed:...)], for breakdowns
            "real_requests": {f: {m: [[x[0], x[2]] for x in v] for m, v in modes.items()} for f, modes in res.items()},
        }
    )
    print("real engines, side by side: " + json.dumps({k: v for k, v in out.items() if isinstance(v, (float, bool))}))
    return out
