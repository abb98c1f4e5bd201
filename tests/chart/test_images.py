"""The two images, checked without Docker (none on the test machines): what the chart runs exists in the
image that runs it. Every container's command is the `kascade` script the image installs and parses
with the real CLI (tests/chart/test_chart_commands.py); here: every port the chart declares is
EXPOSEd by that image, both images are multi-stage, non-root with the uid the chart runs as, install
only hash-pinned locked dependencies, copy every package directory, and the operator image's commands
run without torch (it has none)."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]
IMAGES = {"operator": REPO / "Dockerfile.operator", "engine": REPO / "Dockerfile"}
LOCKS = {"operator": REPO / "requirements" / "operator.lock", "engine": REPO / "requirements" / "engine.lock"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())  # join continuation lines
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    ins = instructions(dockerfile)
    last = max(i for i, (op, _) in enumerate(ins) if op == "FROM")
    return ins[last:]


def exposed(dockerfile: Path) -> set[int]:
    return {int(p.split("/")[0]) for op, rest in final_stage(dockerfile) if op == "EXPOSE" for p in rest.split()}


def lock_pins(lock: Path) -> dict[str, str]:
    pins = {}
    for m in re.finditer(r"^([A-Za-z0-9._-]+)==(\S+)", lock.read_text(), re.M):
        pins[re.sub(r"[-_.]+", "-", m.group(1)).lower()] = m.group(2)
    return pins


def dep_name(spec: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]).lower()


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_image_is_multi_stage_non_root_and_copies_what_exists(image: str) -> None:
    df = IMAGES[image]
    ins = instructions(df)
    assert sum(op == "FROM" for op, _ in ins) >= 2, "multi-stage: build tools stay out of the runtime image"
    users = [rest for op, rest in final_stage(df) if op == "USER"]
    assert users and users[-1].split(":")[0] == "65532", users
    for op, rest in ins:
        if op == "COPY" and "--from" not in rest:
            *srcs, _ = rest.split()
            for s in srcs:
                assert (REPO / s).exists(), f"{df.name}: COPY {s} does not exist"
    # every package directory of the distribution is in the image (else `kascade <cmd>` cannot import it)
    where = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    copied = {rest.split()[0] for op, rest in ins if op == "COPY" and "--from" not in rest}
    assert set(where) <= copied, f"{df.name} misses {set(where) - copied}"
    pip = [rest for op, rest in ins if op == "RUN" and "pip install" in rest]
    assert any("--require-hashes" in r and LOCKS[image].relative_to(REPO).as_posix() in r for r in pip), pip
    assert any("--no-deps" in r for r in pip), "the project itself must not pull unlocked dependencies"


@pytest.mark.parametrize("image", sorted(LOCKS))
def test_lock_pins_every_dependency_with_hashes(image: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = ["operator", "router"] + (["engine"] if image == "engine" else [])
    wanted = {dep_name(d) for d in project["dependencies"]}
    for e in extras:
        wanted |= {dep_name(d) for d in project["optional-dependencies"][e]}
    pins = lock_pins(LOCKS[image])
    assert wanted <= set(pins), f"{LOCKS[image].name} lacks {sorted(wanted - set(pins))}: run `make lock`"
    text = LOCKS[image].read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [b.split()[0] for b in blocks if "==" in b.split("\n")[0] and "--hash=sha256:" not in b]
    assert not unhashed, unhashed
    if image == "operator":
        assert not {"torch", "ucxx-cu12", "transformers"} & set(pins), "the operator image carries no torch"
    else:
        assert pins["torch"].startswith("2.10")


def rendered(helm: Helm, *args: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), *args).stdout) if d]


def test_every_chart_port_is_exposed_by_the_image_that_serves_it(helm: Helm) -> None:
    docs = rendered(helm)
    image_of = {"ghcr.io/kascade/kascade-operator": "operator", "ghcr.io/kascade/kascade-engine": "engine"}
    seen = set()
    for d in docs:
        spec = d["spec"]["template"]["spec"] if d["kind"] == "Deployment" else d["spec"] if d["kind"] == "Pod" else None
        if spec is None:
            continue
        for c in spec["containers"] + spec.get("initContainers", []):
            image = image_of[c["image"].rsplit(":", 1)[0]]
            seen.add(image)
            assert c["args"][0] == "kascade", c["args"]  # the console script both images install
            ports = {p["containerPort"] for p in c.get("ports", [])}
            assert ports <= exposed(IMAGES[image]), f"{d['metadata']['name']}/{c['name']}: {ports - exposed(IMAGES[image])}"
            assert spec["securityContext"].get("runAsUser", 65532) == 65532 or image == "engine"
    assert seen == {"operator", "engine"}
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kascade"] == "kascade_cli.main:cli"


def test_operator_image_commands_run_without_torch(helm: Helm) -> None:
    """What the slim image runs (operator, router, `helm test`'s probe) imports and parses with torch absent."""
    docs = rendered(helm)
    argvs = [c["args"] for d in docs if d["kind"] in ("Deployment", "Pod")
             for c in (d["spec"]["template"]["spec"] if d["kind"] == "Deployment" else d["spec"])["containers"]
             if "kascade-operator" in c["image"]]
    assert len(argvs) == 3 and any("router" in a for a in argvs)  # the router is on by default
    code = (
        "import sys, json\n"
        "for m in ('torch', 'ucxx', 'transformers', 'safetensors'): sys.modules[m] = None  # absent\n"
        "import click\n"
        "from kascade_cli.main import cli\n"
        "import kascade_operator.handlers  # what `operator run` imports\n"
        "import kascade_router.server  # what `router` imports\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    ctx = cli.make_context('kascade', argv[1:])\n"
        "    group, rest = cli, ctx.protected_args + ctx.args\n"
        "    while isinstance(group, click.Group):\n"
        "        name, cmd, rest = group.resolve_command(ctx, rest)\n"
        "        ctx = cmd.make_context(name, rest, parent=ctx)\n"
        "        group, rest = cmd, (ctx.protected_args + ctx.args if isinstance(cmd, click.Group) else [])\n"
        "print('ok', sorted(m for m in ('torch', 'ucxx') if sys.modules.get(m) is not None))\n"
    )
    import json

    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", code, json.dumps(argvs)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok []"
