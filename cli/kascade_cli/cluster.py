"""`kascade cluster up|down|status`: the local control plane for people (tests use the fixture)."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.group()
def cluster() -> None:
    """Start, inspect or stop the local control plane (etcd, apiserver, kcm, scheduler, KWOK)."""


@cluster.command()
@click.option("--nodes", "n_nodes", default=4, show_default=True, type=click.IntRange(0, 5000), help="Fake GPU nodes.")
@click.option("--gpus-per-node", default=8, show_default=True, type=click.IntRange(0, 64))
@click.option("--leaves", default=2, show_default=True, type=click.IntRange(1, 1024), help="Leaf switches.")
@click.option("--crds/--no-crds", default=True, show_default=True, help="Install the Kascade CRDs from crds/.")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None, help="Default: ~/.cache/kascade/cluster.")
def up(n_nodes: int, gpus_per_node: int, leaves: int, crds: bool, state_dir: Path | None) -> None:
    """Start the control plane, create fake GPU nodes with topology labels, install the API."""
    from kascade_devcluster import nodes
    from kascade_devcluster.api import CRD_DIR, install_crds
    from kascade_devcluster.binaries import MissingBinaries
    from kascade_devcluster.controlplane import ControlPlane, StateError, ToolError

    t0 = time.monotonic()
    click.echo("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok ...")
    try:
        cp = ControlPlane.create(state_dir).start(detachable=True)
    except (MissingBinaries, StateError, RuntimeError, TimeoutError) as e:
        # start() has already stopped whatever it started.
        raise click.ClickException(str(e)) from None
    cp.detach()
    click.echo(f"  api server ready at {cp.api_url} ({time.monotonic() - t0:.1f} s); logs in {cp.state_dir / 'logs'}")
    try:
        click.echo(f"  creating {n_nodes} fake GPU nodes ...")
        names = nodes.create_nodes(cp, nodes.topology_specs(n_nodes, gpus_per_node, leaves), "cluster-up")
        click.echo(f"  {len(names)} fake GPU nodes Ready ({gpus_per_node} GPUs each, {leaves} leaves) "
                   f"({time.monotonic() - t0:.1f} s)")
        if crds and any(CRD_DIR.glob("*.yaml")):
            installed = install_crds(cp)
            click.echo(f"  CRDs established: {', '.join(installed)} ({time.monotonic() - t0:.1f} s)")
        elif crds:
            click.echo(f"  no CRDs in {CRD_DIR}: skipped")
    except ToolError as e:
        # The control plane keeps running so the failure can be inspected; say how to stop it.
        raise click.ClickException(f"{e}\n(the control plane is still running: `kascade cluster down`)") from None
    click.echo(f"done in {time.monotonic() - t0:.1f} s.\n  export KUBECONFIG={cp.kubeconfig}\n"
               f"  {cp.bin_dir / 'kubectl'} get nodes -L kascade.io/leaf")


@cluster.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
def down(state_dir: Path | None) -> None:
    """Stop every component of the local control plane."""
    from kascade_devcluster.controlplane import ControlPlane, StateError

    try:
        cp = ControlPlane.load(state_dir)
    except StateError as e:
        raise click.ClickException(str(e)) from None
    cp.stop()
    click.echo("control plane stopped")


@cluster.command()
@click.option("--state-dir", type=click.Path(path_type=Path), default=None)
def status(state_dir: Path | None) -> None:
    """Show which components are running."""
    from kascade_devcluster.controlplane import ControlPlane, StateError

    try:
        cp = ControlPlane.load(state_dir)
    except StateError as e:
        raise click.ClickException(str(e)) from None
    for name, ok in cp.running().items():
        click.echo(f"{name:<24} {'running' if ok else 'DEAD'} (pid {cp.pids[name]})")
    click.echo(f"api {cp.api_url}  kubeconfig {cp.kubeconfig}")
