"""`kascade plan FILE`: plan a scale-up on a topology with every algorithm and compare predictions."""

from __future__ import annotations

import json
from pathlib import Path

import click
import yaml

MAX_BYTES = 4 << 20  # a topology/scenario file; a 100,000-node `nodes:` list fits
MAX_ALIASES = 100  # YAML aliases in one document (an alias bomb expands each one again)


class _BoundedLoader(yaml.SafeLoader):
    """safe_load that refuses documents with many aliases or deep nesting: an alias bomb shares
    nodes, so it loads small but explodes when walked; deep nesting overflows the parser's stack."""

    aliases = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_ALIASES:
                mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]  # PyYAML's stub leaves it untyped
                raise yaml.YAMLError(f"more than {MAX_ALIASES} YAML aliases (line {mark.line + 1}): "
                                     "refusing a possible alias bomb")
        return super().compose_node(parent, index)  # type: ignore[arg-type]


def read_document(path: Path) -> object:
    """The file's single YAML document, bounded in size, aliases and nesting; errors are one line."""
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise click.ClickException(f"{path}: {size} bytes, larger than {MAX_BYTES} (not a topology file?)")
    raw = path.read_bytes()
    if b"\0" in raw:
        raise click.ClickException(f"{path}: binary data (NUL bytes), not a YAML text file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise click.ClickException(f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except yaml.YAMLError as e:
        raise click.ClickException(f"{path}: invalid YAML: {' '.join(str(e).split())[:300]}") from None
    except RecursionError:
        raise click.ClickException(f"{path}: YAML nested too deeply") from None


@click.command()
@click.argument("topology_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-a", "--algorithm", "algorithms", multiple=True,
              type=click.Choice(["auto", "chain", "binomial", "hybrid", "star", "tree", "local"]),
              help="Default: all. auto builds the candidates and keeps the fastest predicted.")
@click.option(
    "--targets", "n_targets", type=click.IntRange(1, 100_000), help="Override scenario.targets with N placed targets."
)
@click.option("--json", "as_json", is_flag=True, help="Print plans and predictions as JSON.")
@click.option("--detail", is_flag=True, help="Per-target predicted completion for each plan.")
def plan(topology_file: Path, algorithms: tuple[str, ...], n_targets: int | None, as_json: bool, detail: bool) -> None:
    """Plan loading a model onto new instances described by TOPOLOGY_FILE (see examples/topologies)."""
    from dataclasses import replace

    from rich.console import Console
    from rich.table import Table

    from kascade_planner.builder import make_plan
    from kascade_planner.cost import lower_bound
    from kascade_planner.plan import PlanError
    from kascade_planner.scenario import place_targets, scenario_from_dict
    from kascade_planner.topology import TopologyError

    doc = read_document(topology_file)
    if not isinstance(doc, dict):
        raise click.ClickException(f"{topology_file}: the document must be a mapping (topology and scenario), "
                                   f"got {type(doc).__name__}")
    try:
        sc = scenario_from_dict(doc)
        if n_targets:
            sc = replace(sc, targets=tuple(place_targets(sc.topology, n_targets, 1, {s.node for s in sc.sources})))
        plans = [make_plan(sc.topology, sc.model, sc.sources, sc.targets, alg, kv_flows=sc.kv_flows,
                           host_cached_nodes=sc.host_cached_nodes)
                 for alg in (algorithms or ("auto", "chain", "binomial", "hybrid", "star", "tree", "local"))]
        names = [f"auto: {p.algorithm}" if alg == "auto" else alg
                 for alg, p in zip(algorithms or ("auto", "chain", "binomial", "hybrid", "star", "tree", "local"),
                                   plans, strict=True)]
    except (PlanError, TopologyError) as e:
        raise click.ClickException(f"{topology_file}: {e}") from None
    except (RecursionError, MemoryError):
        raise click.ClickException(f"{topology_file}: the document is too large or too deeply nested to plan") from None
    if as_json:
        click.echo(json.dumps([{**p.to_dict(), "lowerBound": lower_bound(p, sc.topology)} for p in plans], indent=2))
        return
    import sys

    console = Console(width=None if sys.stdout.isatty() else 160)
    lb = lower_bound(plans[0], sc.topology)
    table = Table(title=f"{sc.model.name}: {sc.model.total_bytes / 1e9:.1f} GB in {len(sc.model.block_ids)} blocks, "
                        f"{len(sc.sources)} source(s) -> {len(sc.targets)} target(s); lower bound {lb:.3f} s")
    for col in ("algorithm", "completion (s)", "x lower bound", "flows", "structure"):
        table.add_column(col, justify="right" if col[0] in "cxf" else "left")
    for name, p in zip(names, plans, strict=True):
        shape = "; ".join(" -> ".join(c) for c in p.chains[:2]) if p.algorithm == "chain" else (
            f"pipelines: {', '.join('+'.join(x) for x in p.pipelines[:2])}" if p.pipelines else "")
        if len(p.chains) > 2 and p.algorithm == "chain":
            shape += f"; ... ({len(p.chains)} chains)"
        table.add_row(name, f"{p.completion:.3f}", f"{p.completion / lb:.2f}", str(len(p.flows)), shape)
    console.print(table)
    for p in plans:
        for n in p.notes:
            console.print(f"[dim]{p.algorithm}: {n}[/dim]")
    if detail:
        for p in plans:
            t = Table(title=f"{p.algorithm}: predicted completion per target")
            t.add_column("target")
            t.add_column("node")
            t.add_column("seconds", justify="right")
            for tid, sec in sorted(p.predicted, key=lambda x: x[1]):
                t.add_row(tid, p.instance(tid).node, f"{sec:.3f}")
            console.print(t)
