"""The two images, checked without Docker (tests/chart/test_images_docker.py builds and runs them): what the
chart runs exists in the image that runs it. Every container's command is the `kascade` script the image
installs and parses with the real CLI (tests/chart/test_chart_commands.py); here: every port the chart
declares is EXPOSEd by that image, both images are multi-stage, non-root with the uid the chart runs as,
get every package directory in their build context, are tagged as the chart pulls them, and the operator
image's commands run without torch (it has none). Their locks: test_image_locks.py; their lint:
test_dockerfile_lint.py; the chart's ports: test_chart_ports.py."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib

import pytest
import yaml
from images import CHART, IMAGES, REPO, Helm, exposed, final_stage, instructions, rendered, stage


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
    # the project is the whole (allowlisted) context: every package directory of the distribution is in
    # it (else `kascade <cmd>` cannot import it) - test_dockerignore_* checks the allowlist
    copied = {rest.split()[0] for op, rest in ins if op == "COPY" and "--from" not in rest}
    assert "." in copied and "requirements" in copied, copied
    # what reaches the runtime from the build stages: the dependencies' venv into the `deps` stage (the
    # layer hack/build-images.sh keeps per lock), the final stage from it (DEPS) with the project on top (its
    # own small layer: a code change does not rebuild the multi-GB one)
    assert [rest for op, rest in stage(df, "deps") if op == "COPY"] == ["--from=build /opt/kascade /opt/kascade"]
    assert final_stage(df)[0] == ("FROM", "${DEPS}") and ("ARG", "DEPS=deps") in ins
    project = "--from=project /opt/kascade-app /opt/kascade-app"
    assert [rest for op, rest in final_stage(df) if op == "COPY"] == [project]
    # the project stage does not start from the dependencies (else a code change would need them built)
    assert [rest for op, rest in ins if op == "FROM" and rest.endswith(" AS project")] == ["pybase AS project"]
    # the RUNs that install with pip (not an apt-get install or a pip uninstall beside a pip variable)
    pip = [rest for op, rest in ins if op == "RUN" and re.search(r"\bpip(\s+--python\s+\S+)?\s+install\s", rest)]
    # the lock is the base interpreter's: requirements/py<X.Y>/<image>.lock, hashes required
    assert any("--require-hashes" in r and f"lock=requirements/py$py/{image}.lock" in r and '-r "$lock"' in r
               and "--only-binary :all:" in r for r in pip), pip
    assert any("--require-hashes -r requirements/build.lock" in r for r in pip), "the build backend is hashed too"
    assert all("--no-deps" in r for r in pip if "$lock" in r or "kascade-*.whl" in r), \
        "the project itself must not pull unlocked dependencies"
    assert all("--no-cache-dir" in r for r in pip)

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
            assert ports <= exposed(IMAGES[image]), (
                f"{d['metadata']['name']}/{c['name']}: {ports - exposed(IMAGES[image])}"
            )
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

    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, json.dumps(argvs)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok []"

def dockerignore_patterns() -> list[tuple[re.Pattern[str], bool]]:
    """.dockerignore as (regex, negated) in file order (Docker's rules: `**` any depth, `*`/`?` within a
    path segment, a matching directory excludes everything under it, `!` re-includes)."""
    out = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        neg = line.startswith("!")
        pat = line.lstrip("!").strip("/")
        rx = (
            re.escape(pat)
            .replace(r"\*\*/", "(.*/)?")
            .replace(r"\*\*", ".*")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        out.append((re.compile(rf"^{rx}(/.*)?$"), neg))
    return out


def ignored(path: str, patterns: list[tuple[re.Pattern[str], bool]]) -> bool:
    result = False
    for rx, neg in patterns:
        if rx.match(path):
            result = not neg
    return result


def test_dockerignore_keeps_every_copied_file_and_drops_the_heavy_ones() -> None:
    """The build context is an allowlist: every tracked file of every package directory pyproject.toml
    names (and the locks, the metadata files) is in it; tests, docs, charts and the heavy local trees are not."""
    pats = dockerignore_patterns()
    assert ignored("engine/kascade_engine/__pycache__/x.pyc", pats) and ignored("docs/install.md", pats)
    assert not ignored("engine/kascade_engine/http/server.py", pats)
    for heavy in (".git", ".venv", "bench/results", "kascade.egg-info", "engine/kascade.egg-info", "tests/chart",
                  "charts/kascade/values.yaml", ".kascade/pip-tmp", "bench/x.py"):
        assert ignored(heavy, pats), f".dockerignore should drop {heavy} from the build context"
    where = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["where"]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for src in [*where, "requirements", "pyproject.toml", "README.md", "LICENSE"]:
        files = [f for f in tracked if f == src or f.startswith(src.rstrip("/") + "/")]
        assert files, f"{src} matches no tracked file"
        gone = [f for f in files if ignored(f, pats) and not f.endswith(".pyc")]
        assert not gone, f"the images need {src} but .dockerignore drops {gone[:5]}"

def test_images_are_tagged_as_the_chart_pulls_them(helm: Helm) -> None:
    """`make images` names its images exactly what the chart renders by default (repository from
    values.yaml, tag = appVersion), so a loaded image needs no --set (the CPU engine: pool.image.tag)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(REPO)}
    listed = subprocess.run(["bash", "hack/build-images.sh", "--list"], cwd=REPO, capture_output=True, text=True,
                            check=True, env={**env, "IMAGES": "operator engine engine-cpu"}).stdout
    names = dict(line.split() for line in listed.splitlines())
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    tag = subprocess.run(
        ["bash", "hack/image-tag.sh"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert tag == app_version
    make = subprocess.run(
        ["make", "-n", "images"], cwd=REPO, capture_output=True, text=True, check=True, env=env
    ).stdout
    assert f"TAG={app_version} " in make and "hack/build-images.sh" in make, make
    images = set()
    for d in rendered(helm):
        spec = d["spec"]["template"]["spec"] if d["kind"] == "Deployment" else d["spec"] if d["kind"] == "Pod" else None
        for c in (spec or {}).get("containers", []) + (spec or {}).get("initContainers", []):
            images.add(c["image"])
    assert images == {names["operator"], names["engine"]}, (images, names)
    assert names["engine-cpu"] == names["engine"] + "-cpu"
    cpu = {c["image"] for d in rendered(helm, "--set", "pool.image.tag=" + app_version + "-cpu")
           if d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]}
    assert names["engine-cpu"] in cpu
