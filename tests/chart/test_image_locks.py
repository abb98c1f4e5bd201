"""The images' dependency locks, checked without Docker: one hash-pinned lock per image and per CPython a
base can carry, agreeing across Pythons, satisfying pyproject's requirements, and the CUDA base matching the
CUDA runtime torch's locked wheels carry."""

from __future__ import annotations

import re
import tomllib

import pytest
from images import BASE_PYTHON, IMAGES, LOCKS, PYTHONS, REPO, dep_name, lock_pins


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

def test_cuda_base_matches_the_locked_cuda_runtime() -> None:
    """torch's CUDA 12.x wheels carry their runtime: the CUDA base is that runtime's minor version, and
    the base's Python (Ubuntu 24.04: 3.12) has a lock."""
    base = re.search(r"^ARG BASE=(\S+)", IMAGES["engine"].read_text(), re.M)
    assert base and BASE_PYTHON[base.group(1)] in PYTHONS
    cuda = re.search(r"nvidia/cuda:(\d+\.\d+)\.", base.group(1))
    for py in PYTHONS:
        runtime = lock_pins(LOCKS["engine", py])["nvidia-cuda-runtime-cu12"]
        assert cuda and runtime.startswith(cuda.group(1) + "."), (py, cuda, runtime)
