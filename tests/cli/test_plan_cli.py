"""`kascade plan`: tables, JSON, and clear errors for bad topology files and flags."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kascade_cli.main import cli

REPO = Path(__file__).resolve().parents[2]
UNIFORM = str(REPO / "examples/topologies/uniform.yaml")


def test_table_lists_every_algorithm_with_predictions() -> None:
    out = CliRunner().invoke(cli, ["plan", UNIFORM])
    assert out.exit_code == 0, out.output
    for alg in ("chain", "binomial", "star", "tree", "local"):
        assert f"│ {alg}" in out.output
    assert "lower bound 1.280 s" in out.output


def test_json_is_a_list_of_plans_that_round_trip(tmp_path: Path) -> None:
    from kascade_planner.plan import Plan

    out = CliRunner().invoke(cli, ["plan", UNIFORM, "--json", "-a", "chain", "-a", "star", "--targets", "4"])
    assert out.exit_code == 0, out.output
    docs = json.loads(out.output)
    assert [d["algorithm"] for d in docs] == ["chain", "star"]
    plans = [Plan.from_dict(d) for d in docs]
    assert all(len(p.targets) == 4 for p in plans)
    assert max(docs[1]["predicted"].values()) > 3 * max(docs[0]["predicted"].values())  # star: ~4x chains


def test_every_example_topology_plans() -> None:
    for f in sorted((REPO / "examples/topologies").glob("*.yaml")):
        out = CliRunner().invoke(cli, ["plan", str(f), "--detail"])
        assert out.exit_code == 0, (f, out.output)
        assert "predicted completion" in out.output and "seconds" in out.output


def test_bad_files_and_flags(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("generate: {leaves: 1, nodesPerLeaf: 2}\nscenario:\n  sources: [{id: s, node: nowhere}]\n  targets: []\n")
    out = CliRunner().invoke(cli, ["plan", str(bad)])
    assert out.exit_code == 1
    assert "scenario.sources[0]: unknown node 'nowhere'" in out.output
    out = CliRunner().invoke(cli, ["plan", UNIFORM, "--targets", "1000"])
    assert out.exit_code == 1 and "exceeds the" in out.output
    out = CliRunner().invoke(cli, ["plan", UNIFORM, "-a", "teleport"])
    assert out.exit_code == 2 and "teleport" in out.output
