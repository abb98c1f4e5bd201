"""The two images' build files as tests read them, without Docker: the Dockerfiles' instructions (continuation
lines joined), their stages and EXPOSEd ports, the hashed requirement locks (one per image and CPython), and the
chart rendered by `helm template`. Used by tests/chart/test_images.py, test_image_locks.py, test_dockerfile_lint.py
and test_chart_ports.py."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kascade"
Helm = Callable[..., subprocess.CompletedProcess[str]]
IMAGES = {"operator": REPO / "Dockerfile.operator", "engine": REPO / "Dockerfile"}
# one lock directory per CPython an image's base can have (hack/lock.sh LOCK_PYTHONS)
PYTHONS = sorted(p.name.removeprefix("py") for p in (REPO / "requirements").glob("py3.*"))
LOCKS = {(image, py): REPO / "requirements" / f"py{py}" / f"{image}.lock" for image in IMAGES for py in PYTHONS}
# `helm template` arguments that render the ServiceMonitor and the PodMonitor (their CRDs' API versions offered)
MONITORS = ("--set", "monitoring.serviceMonitor.enabled=true",
            "--api-versions", "monitoring.coreos.com/v1/ServiceMonitor",
            "--set", "monitoring.podMonitor.enabled=true", "--api-versions", "monitoring.coreos.com/v1/PodMonitor")
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

def rendered(helm: Helm, *args: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(helm("template", "rel", str(CHART), *args).stdout) if d]
