"""The Dockerfiles' lint: hadolint's and BuildKit's rules on the official parser's view of each file, and a
deliberately bad Dockerfile that proves every rule fires."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from images import IMAGES

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
