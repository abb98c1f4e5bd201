"""`kascade demo`: Kascade end to end on this machine — control plane, Helm install, real engines, the
operator, a burst of requests, the scale-up by chain and the scale-down — shown live in the terminal
and saved as a plot.

Data flow: flags -> `DemoConfig` -> `kascade_demo.scenario.Demo.run()` -> `DemoResult` -> exit code
(non-zero with a clear message when a step fails; everything started is stopped either way).
"""

from __future__ import annotations

import logging
from pathlib import Path

import click


@click.command("demo")
@click.option("--model", type=click.Choice(["tiny", "smollm"]), default="tiny", show_default=True,
              help="tiny: a random 8-layer Llama built offline; smollm: SmolLM2-135M (real text, slower on CPU)")
@click.option(
    "--nodes", default=4, show_default=True, type=click.IntRange(3, 16), help="fake GPU nodes (one engine each)"
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("kascade-demo"),
    show_default=True,
    help="where the plot, the logs and the cluster state go",
)
@click.option("--burst-seconds", default=25.0, show_default=True, type=click.FloatRange(5, 600))
@click.option("--keep", is_flag=True, help="leave the control plane running afterwards (prints its KUBECONFIG)")
def demo(model: str, nodes: int, out: Path, burst_seconds: float, keep: bool) -> None:
    """Run the end-to-end demo (a few minutes; needs `make install`)."""
    from kascade_demo.scenario import Demo, DemoConfig
    from kascade_devcluster.binaries import MissingBinaries
    from kascade_devcluster.controlplane import StateError, ToolError
    from kascade_devcluster.waiting import Timeout

    logging.getLogger("kascade_devcluster").setLevel(logging.WARNING)  # the demo prints its own story
    try:
        res = Demo(DemoConfig(model=model, nodes=nodes, out=out, keep=keep, burst_s=burst_seconds)).run()
    except MissingBinaries as e:
        raise click.ClickException(f"{e}\nrun `make install` first (it builds the control plane once)") from None
    except (StateError, ToolError, Timeout, RuntimeError, ValueError) as e:
        raise click.ClickException(f"demo failed: {e}\n(logs: {out / 'logs'})") from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; everything the demo started has been stopped") from None
    if res.requests_failed or res.max_ready < 2 or res.final_ready != 1:
        raise click.ClickException(
            f"demo finished but did not show a clean burst: max ready {res.max_ready}, "
            f"final {res.final_ready}, failed requests {res.requests_failed}"
        )


@click.command("demo-kind")
@click.option("--cluster", default="kascade-demo", show_default=True, help="kind cluster name (reused if it exists)")
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("kascade-demo-kind"),
    show_default=True,
    help="where the plot and the cluster's kubeconfig go",
)
@click.option("--burst-seconds", default=40.0, show_default=True, type=click.FloatRange(5, 600))
def demo_kind(cluster: str, out: Path, burst_seconds: float) -> None:
    """The demo on a kind cluster: the chart's own pods from images built here (`make demo-kind` builds
    what is missing first; docs/kind.md). The cluster is kept; the end says how to remove it."""
    from kascade_demo.kind import KindDemo
    from kascade_demo.kindcluster import KindError
    from kascade_demo.scenario import DemoConfig
    from kascade_devcluster.waiting import Timeout

    out.mkdir(parents=True, exist_ok=True)
    try:
        res = KindDemo(DemoConfig(out=out, burst_s=burst_seconds, calm_timeout_s=120.0), cluster).run()
    except (KindError, Timeout, RuntimeError) as e:
        raise click.ClickException(f"demo-kind failed: {e}") from None
    except KeyboardInterrupt:
        raise click.ClickException("interrupted; the kind cluster is kept (see above to remove it)") from None
    if res.requests_failed or res.max_ready < 2 or res.final_ready != 1:
        raise click.ClickException(
            f"demo-kind finished but did not show a clean burst: max ready {res.max_ready}, "
            f"final {res.final_ready}, failed requests {res.requests_failed}"
        )
