"""The two images, checked without Docker (tests/chart/test_images_docker.py builds and runs them): what the
chart runs exists in the image that runs it. Every container's command is the `kascade` script the image
installs and parses with the real CLI (tests/chart/test_chart_commands.py); here: every port the chart
declares is EXPOSEd by that image, both images are multi-stage, non-root with the uid the chart runs as,
install only hash-pinned locked dependencies (one lock per CPython a base can have), get every package
directory in their build context, are tagged as the chart pulls them, and the operator image's commands
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
# one lock directory per CPython an image's base can have (hack/lock.sh LOCK_PYTHONS)
PYTHONS = sorted(p.name.removeprefix("py") for p in (REPO / "requirements").glob("py3.*"))
LOCKS = {(image, py): REPO / "requirements" / f"py{py}" / f"{image}.lock" for image in IMAGES for py in PYTHONS}
# the Python each base the images are built on carries (Dockerfile defaults, hack/build-images.sh's bases)
BASE_PYTHON = {"nvidia/cuda:12.8.1-base-ubuntu24.04": "3.12", "ubuntu:24.04": "3.12",
               "python:3.12-slim-bookworm": "3.12", "kascade/base:bookworm": "3.11"}


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


def stage(dockerfile: Path, name: str) -> list[tuple[str, str]]:
    ins = instructions(dockerfile)
    first = next(i for i, (op, rest) in enumerate(ins) if op == "FROM" and rest.endswith(f" AS {name}"))
    end = next((i for i in range(first + 1, len(ins)) if ins[i][0] == "FROM"), len(ins))
    return ins[first:end]


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
    pip = [rest for op, rest in ins if op == "RUN" and "pip" in rest and " install " in rest]
    # the lock is the base interpreter's: requirements/py<X.Y>/<image>.lock, hashes required
    assert any("--require-hashes" in r and f"lock=requirements/py$py/{image}.lock" in r and '-r "$lock"' in r
               and "--only-binary :all:" in r for r in pip), pip
    assert any("--require-hashes -r requirements/build.lock" in r for r in pip), "the build backend is hashed too"
    assert all("--no-deps" in r for r in pip if "$lock" in r or "kascade-*.whl" in r), \
        "the project itself must not pull unlocked dependencies"
    assert all("--no-cache-dir" in r for r in pip)


def test_a_lock_for_every_python_the_bases_carry() -> None:
    """Each base an image is built on (the Dockerfiles' registry defaults, the local Debian base) has its
    interpreter's locks, and `make lock` regenerates exactly those."""
    defaults = {re.search(r"^ARG BASE=(\S+)", df.read_text(), re.M).group(1) for df in IMAGES.values()}  # type: ignore[union-attr]
    script = (REPO / "hack" / "build-images.sh").read_text()
    bases = defaults | set(re.findall(r"\]=(\S+?:[\w.-]+)", script.split("registry_base=", 1)[1].split("\n\n")[0]))
    base_script = (REPO / "hack" / "build-base-image.sh").read_text()
    bases.add(re.search(r"NAME=\$\{KASCADE_BASE_IMAGE:-(\S+)\}", base_script).group(1))  # type: ignore[union-attr]
    assert bases <= set(BASE_PYTHON), f"which CPython does {bases - set(BASE_PYTHON)} carry? add it to BASE_PYTHON"
    assert {BASE_PYTHON[b] for b in bases} == set(PYTHONS) == {"3.11", "3.12"}
    lock_pythons = re.search(r"LOCK_PYTHONS:-([\d. ]+)\}", (REPO / "hack" / "lock.sh").read_text())
    assert lock_pythons and set(lock_pythons.group(1).split()) == set(PYTHONS)
    assert all(path.exists() for path in LOCKS.values())


def test_locks_agree_across_pythons() -> None:
    """Images built on different bases run the same versions: a package pinned in two Pythons' locks
    differs only where the newer pin dropped the older interpreter (numpy 2.5 and its dependants need 3.12)."""
    for image in IMAGES:
        old, new = (lock_pins(LOCKS[image, py]) for py in PYTHONS)
        differ = {name for name in set(old) & set(new) if old[name] != new[name]}
        assert differ <= {"numpy", "scipy", "networkx"}, (image, {n: (old[n], new[n]) for n in differ})


@pytest.mark.parametrize(("image", "py"), sorted(LOCKS))
def test_lock_pins_every_dependency_with_hashes(image: str, py: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = ["operator", "router"] + (["engine"] if image == "engine" else [])
    wanted = {dep_name(d) for d in project["dependencies"]}
    for e in extras:
        wanted |= {dep_name(d) for d in project["optional-dependencies"][e]}
    pins = lock_pins(LOCKS[image, py])
    assert wanted <= set(pins), f"{LOCKS[image, py]} lacks {sorted(wanted - set(pins))}: run `make lock`"
    text = LOCKS[image, py].read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    unhashed = [b.split()[0] for b in blocks if "==" in b.split("\n")[0] and "--hash=sha256:" not in b]
    assert not unhashed, unhashed
    if image == "operator":
        assert not {"torch", "ucxx-cu12", "transformers"} & set(pins), "the operator image carries no torch"
    else:
        assert pins["torch"].startswith("2.10")


@pytest.mark.parametrize(("image", "py"), sorted(LOCKS))
def test_lock_versions_satisfy_pyproject(image: str, py: str) -> None:
    """A requirement raised in pyproject.toml without `make lock` would install an older version in the
    image than the code needs: every direct dependency's pinned version meets its specifier (markers
    evaluated for the lock's platform: that CPython on Linux x86_64)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = ["operator", "router"] + (["engine"] if image == "engine" else [])
    reqs = [
        Requirement(d)
        for d in project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
    ]
    env = {"python_version": py, "python_full_version": f"{py}.2", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython", "extra": ""}
    pins = lock_pins(LOCKS[image, py])
    checked = 0
    for r in reqs:
        if r.marker is not None and not r.marker.evaluate(env):
            continue
        pinned = pins[dep_name(r.name)]
        assert r.specifier.contains(Version(pinned), prereleases=True), \
            f"{LOCKS[image, py]}: {r.name}=={pinned} does not meet pyproject's {r}: run `make lock`"
        checked += 1
    assert checked >= (8 if image == "operator" else 15)


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


# Lint rules (hadolint's DLxxxx / BuildKit's check names) on the official parser's view of each Dockerfile:
# `dockerfile` wraps moby/buildkit's Go parser, so a Dockerfile it rejects would not build either.
SECRETY = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|API_?KEY|PRIVATE_?KEY)", re.I)


def lint(df: Path) -> list[str]:
    dockerfile = pytest.importorskip("dockerfile", reason="the `dockerfile` parser (dev extra) is not installed")
    cmds = dockerfile.parse_file(str(df))
    problems: list[str] = []
    args = {c.value[0].split("=", 1)[0]: c.value[0].split("=", 1)[1] for c in cmds
            if c.cmd == "ARG" and "=" in c.value[0]}
    stages: list[str] = []
    for c in cmds:
        where = f"{df.name}:{c.start_line}"
        if c.cmd == "FROM":
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), m.group(0)), c.value[0])
            if image in stages:
                pass  # an earlier stage: pinned by what built it
            elif "$" in image:
                problems.append(f"{where} InvalidDefaultArgInFrom: {c.value[0]} has no default")
            elif ":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest"):
                problems.append(f"{where} DL3006/DL3007: base image {image} is not pinned to a tag")
            if len(c.value) == 3:
                if c.value[1] not in ("AS", "as") or (c.value[1] == "as") != (c.original.split()[0] == "from"):
                    problems.append(f"{where} FromAsCasing: {c.original}")
                stages.append(c.value[2])
        elif c.cmd == "ADD":
            problems.append(f"{where} DL3020: use COPY, not ADD")
        elif c.cmd == "COPY":
            for f in c.flags:
                if f.startswith("--from=") and f.split("=", 1)[1] not in stages:
                    problems.append(f"{where}: COPY {f} names no earlier stage")
        elif c.cmd == "WORKDIR" and not c.value[0].startswith("/"):
            problems.append(f"{where} DL3000: WORKDIR {c.value[0]} is relative")
        elif c.cmd in ("CMD", "ENTRYPOINT") and not c.json:
            problems.append(f"{where} JSONArgsRecommended/DL3025: {c.cmd} in shell form")
        elif c.cmd in ("ENV", "ARG"):
            names = c.value[::2] if c.cmd == "ENV" else [v.split("=", 1)[0] for v in c.value]
            problems += [f"{where} SecretsUsedInArgOrEnv: {n}" for n in names if SECRETY.search(n)]
        elif c.cmd == "RUN":
            run = c.value[0]
            if re.search(r"(^|&&|;)\s*(sudo|cd)\s", run):
                problems.append(f"{where} DL3004/DL3003: sudo or cd in RUN")
            if "apt-get install" in run:
                for need, rule in ((r"apt-get update", "DL3009"), (r"--no-install-recommends", "DL3015"),
                                   (r"install\s+(-\w*y\w*|--yes|--assume-yes)\s", "DL3014"),
                                   (r"rm -rf /var/lib/apt/lists", "DL3009")):
                    if not re.search(need, run):
                        problems.append(f"{where} {rule}: apt-get install without {need} in the same RUN")
            if "pip install" in run and "--no-cache-dir" not in run:
                problems.append(f"{where} DL3042: pip install without --no-cache-dir")
    return problems


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_dockerfile_lint(image: str) -> None:
    assert lint(IMAGES[image]) == []


def test_lint_catches_what_it_claims(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("ARG BASE\nFROM ${BASE} as build\nFROM python:latest\nFROM build AS fine\nADD . /src\nWORKDIR src\n"
                   "ENV HF_TOKEN=x\nRUN apt-get install curl && pip install x\nCOPY --from=bulid /a /b\n"
                   "CMD kascade --help\n")
    rules = {p.split()[1].split("/")[0].rstrip(":") for p in lint(bad)}
    assert rules == {
        "InvalidDefaultArgInFrom",
        "FromAsCasing",
        "DL3006",
        "DL3020",
        "DL3000",
        "SecretsUsedInArgOrEnv",
        "DL3009",
        "DL3015",
        "DL3014",
        "DL3042",
        "JSONArgsRecommended",
        "COPY",
    }, lint(bad)


def test_cuda_base_matches_the_locked_cuda_runtime() -> None:
    """torch's CUDA 12.x wheels carry their runtime: the CUDA base is that runtime's minor version, and
    the base's Python (Ubuntu 24.04: 3.12) has a lock."""
    base = re.search(r"^ARG BASE=(\S+)", IMAGES["engine"].read_text(), re.M)
    assert base and BASE_PYTHON[base.group(1)] in PYTHONS
    cuda = re.search(r"nvidia/cuda:(\d+\.\d+)\.", base.group(1))
    for py in PYTHONS:
        runtime = lock_pins(LOCKS["engine", py])["nvidia-cuda-runtime-cu12"]
        assert cuda and runtime.startswith(cuda.group(1) + "."), (py, cuda, runtime)


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


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    sel = selector.get("matchLabels", selector if "matchExpressions" not in selector else {})
    if any(labels.get(k) != v for k, v in sel.items() if k != "matchExpressions"):
        return False
    for e in selector.get("matchExpressions", []):
        present = e["key"] in labels
        missing_in = e["operator"] == "In" and labels.get(e["key"]) not in e["values"]
        if (e["operator"] == "Exists" and not present) or missing_in:
            return False
    return True


@pytest.mark.filterwarnings("ignore:'protected_args' is deprecated")
def test_every_port_the_chart_wires_is_declared_and_listened_on(helm: Helm, tmp_path: Path) -> None:
    """Services, ServiceMonitor/PodMonitor, NetworkPolicies and probes name ports the selected pods declare,
    and each declared port is one the container's `kascade` command listens on (parsed by the real CLI);
    the data port is the one the operator hands to engines in plans (from the port named `data`)."""
    from urllib.parse import urlparse

    import click

    from kascade_cli.main import cli
    from kascade_operator import labels as L
    from kascade_operator.api import ModelServiceSpec
    from kascade_operator.podtemplate import fallback_pod
    from kascade_operator.pool import pod_view

    (tmp_path / "m").mkdir()  # click checks the checkpoint directory exists, as it would in the pod
    docs = rendered(
        helm,
        "--set",
        "monitoring.serviceMonitor.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/ServiceMonitor",
        "--set",
        "monitoring.podMonitor.enabled=true",
        "--api-versions",
        "monitoring.coreos.com/v1/PodMonitor",
        "--set",
        f"pool.model.mountPath={tmp_path}",
        "--set",
        f"pool.model.path={tmp_path / 'm'}",
    )
    # a pool pod serving: the operator's serving label added (what the engines Service selects)
    serving = {"kascade.io/serving": "true"}
    pods = [
        (
            d["metadata"]["name"],
            {**d["spec"]["template"]["metadata"]["labels"], **(serving if d["metadata"]["name"] == "rel-pool" else {})},
            d["spec"]["template"]["spec"],
        )
        for d in docs
        if d["kind"] == "Deployment"
    ]
    spec = ModelServiceSpec.model_validate(
        {
            "model": {"name": "m", "source": {"path": str(tmp_path / "m")}},
            "engine": {"image": "i:1", "port": 8100, "dataPort": 18600},
            "mode": "colocated",
            "replicas": {"colocated": {"min": 1, "max": 2}},
        }
    )
    fb = fallback_pod(spec, "svc", "tok", None)  # a service's own engine ports, unlike the pool's
    all_pods = [*pods, ("fallback", fb["metadata"]["labels"], fb["spec"])]

    def ports(pod_spec: dict[str, Any]) -> dict[str | int, int]:
        out: dict[str | int, int] = {}
        for c in pod_spec["containers"]:
            for p in c.get("ports", []):
                out[p["containerPort"]] = p["containerPort"]
                if "name" in p:
                    out[p["name"]] = p["containerPort"]
        return out

    for name, _, pod_spec in all_pods:
        for c in pod_spec["containers"]:
            declared = {p["containerPort"] for p in c.get("ports", []) if p.get("name") != "data"}
            ctx = cli.make_context("kascade", list(c["args"][1:]))
            group, rest = cli, ctx.protected_args + ctx.args
            while isinstance(group, click.Group):
                cmd_name, cmd, rest = group.resolve_command(ctx, rest)
                assert cmd is not None
                ctx = cmd.make_context(cmd_name or "", rest, parent=ctx)
                group, rest = cmd, (ctx.protected_args + ctx.args if isinstance(cmd, click.Group) else [])
            listening = {v for k, v in ctx.params.items() if k.endswith("port") and isinstance(v, int) and v}
            listening |= {
                urlparse(v).port for v in ctx.params.values() if isinstance(v, str) and v.startswith("http://0.0.0.0")
            }
            assert declared == listening, f"{name}/{c['name']}: declares {declared}, listens on {listening}"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    assert c[probe]["httpGet"]["port"] in ports(pod_spec), f"{name}/{c['name']} {probe}"
        if "data" in ports(pod_spec):  # the operator reads the data endpoint from the port named `data`
            view = pod_view(
                {"metadata": {"name": name, "labels": {}}, "spec": pod_spec, "status": {"podIP": "10.0.0.9"}}
            )
            assert view.data_endpoint == f"10.0.0.9:{ports(pod_spec)['data']}", name
            assert L.DATA_ENDPOINT == "kascade.io/data-endpoint"

    services = [d for d in docs if d["kind"] == "Service"]
    assert {s["metadata"]["name"] for s in services} >= {"rel-engines", "rel-operator-metrics", "rel-router"}
    for svc in services:
        selected = [p for p in pods if _selects(svc["spec"]["selector"], p[1])]
        assert selected, f"Service {svc['metadata']['name']} selects no pod"
        for sp in svc["spec"]["ports"]:
            for name, _, pod_spec in selected:
                assert sp["targetPort"] in ports(pod_spec), (
                    f"Service {svc['metadata']['name']} -> {name}: {sp['targetPort']}"
                )
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert {m["kind"] for m in monitors} == {"ServiceMonitor", "PodMonitor"}
    for m in monitors:
        if m["kind"] == "ServiceMonitor":
            svcs = [s for s in services if _selects(m["spec"]["selector"], s["metadata"]["labels"])]
            assert svcs, m["metadata"]["name"]
            for e in m["spec"]["endpoints"]:
                assert all(e["port"] in {p.get("name") for p in s["spec"]["ports"]} for s in svcs), (
                    m["metadata"]["name"],
                    e,
                )
        else:
            selected = [p for p in all_pods if _selects(m["spec"]["selector"], p[1])]
            assert {p[0] for p in selected} >= {"rel-pool", "fallback"}, [p[0] for p in selected]
            for e in m["spec"]["podMetricsEndpoints"]:
                assert all(e["port"] in ports(p[2]) for p in selected), (m["metadata"]["name"], e)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policies
    for pol in policies:
        selected = [p for p in all_pods if _selects(pol["spec"]["podSelector"], p[1])]
        assert selected, pol["metadata"]["name"]
        for rule in pol["spec"].get("ingress", []):
            for rp in rule.get("ports", []):
                assert all(rp["port"] in ports(p[2]) for p in selected), (
                    pol["metadata"]["name"],
                    rp,
                    [p[0] for p in selected],
                )
