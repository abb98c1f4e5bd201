"""`kascade plan`: tables, JSON, and clear errors for bad topology files and flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
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
    bad.write_text(
        "generate: {leaves: 1, nodesPerLeaf: 2}\nscenario:\n  sources: [{id: s, node: nowhere}]\n  targets: []\n"
    )
    out = CliRunner().invoke(cli, ["plan", str(bad)])
    assert out.exit_code == 1
    assert "scenario.sources[0]: unknown node 'nowhere'" in out.output
    out = CliRunner().invoke(cli, ["plan", UNIFORM, "--targets", "1000"])
    assert out.exit_code == 1 and "exceeds the" in out.output
    out = CliRunner().invoke(cli, ["plan", UNIFORM, "-a", "teleport"])
    assert out.exit_code == 2 and "teleport" in out.output


BOMB = """a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
j: &j [*i,*i,*i,*i,*i,*i,*i,*i,*i]
k: &k [*j,*j,*j,*j,*j,*j,*j,*j,*j]
l: &l [*k,*k,*k,*k,*k,*k,*k,*k,*k]
m: &m [*l,*l,*l,*l,*l,*l,*l,*l,*l]
nodes: *m
"""
GOOD = (
    "generate: {leaves: 1, nodesPerLeaf: 3, nicGbps: 100}\nscenario:\n  model: {layers: 4, sizeGB: 1}\n"
    "  sources: [{id: s, node: node-0-0}]\n  targets: {count: 2}\n"
)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (BOMB, "more than 100 YAML aliases"),
        (GOOD.replace("sizeGB: 1", "sizeGB: .nan"), "scenario.model.sizeGB must be a number in (0, 1e+06], got nan"),
        (GOOD.replace("sizeGB: 1", "sizeGB: .inf"), "scenario.model.sizeGB must be a number in (0, 1e+06], got inf"),
        (GOOD.replace("nicGbps: 100", "nicGbps: 0"), "generate.nicGbps must be a number in (0, 1e+06], got 0"),
        (
            "nodes: [{name: a, leaf: l, gpus: 8, nicGbps: 0}]\nscenario: {sources: [], targets: []}\n",
            "node 'a': nicGbps must be a finite number >= 1e-09, got 0",
        ),
        (
            GOOD.replace("layers: 4", "layers: 1000000000"),
            "scenario.model.layers must be an integer in [1, 10000], got 1000000000",
        ),
        (
            GOOD.replace("layers: 4", "layers: 1.0e+9"),
            "scenario.model.layers must be an integer in [1, 10000], got 1000000000.0",
        ),
        (GOOD.replace("count: 2", "count: lots"), "scenario.targets.count must be a number, got 'lots'"),
        (
            GOOD.replace("nodesPerLeaf: 3", "nodesPerLeaf: 1000000"),
            "generate.nodesPerLeaf must be an integer in [1, 100000]",
        ),
        (GOOD + "interLeafBandwidthRatio: .nan\n", "interLeafBandwidthRatio must be a number in (0, 1], got nan"),
        ("[" * 5000, "nested too deeply"),
        ("- just\n- a list\n", "the document must be a mapping"),
    ],
)
def test_hostile_input_gives_one_line_naming_the_field(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(content)
    out = CliRunner().invoke(cli, ["plan", str(f)])
    assert out.exit_code == 1, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit), repr(out.exception)
    assert message in out.output, out.output
    assert len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"\x7fELF\x02\x01\x01\x00\x00", "binary data (NUL bytes)"), (b"nodes: \xff\xfe", "not UTF-8 text (byte 7")],
)
def test_binary_input_is_refused(tmp_path: Path, data: bytes, message: str) -> None:
    f = tmp_path / "in.yaml"
    f.write_bytes(data)
    out = CliRunner().invoke(cli, ["plan", str(f)])
    assert out.exit_code == 1 and message in out.output and len(out.output.strip().splitlines()) == 1, out.output


def test_the_good_document_plans(tmp_path: Path) -> None:
    f = tmp_path / "in.yaml"
    f.write_text(GOOD)
    out = CliRunner().invoke(cli, ["plan", str(f), "-a", "auto"])
    assert out.exit_code == 0 and "auto: " in out.output, out.output
