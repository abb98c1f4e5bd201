"""The images as built by `make images` (hack/build-images.sh), run with Docker the way the chart runs them:
as uid 65532 with a read-only root filesystem and a /tmp tmpfs. The operator image starts every command
the chart gives it; the engine images (CUDA wheels and -cpu) serve a tiny random Llama from a read-only
volume and answer an OpenAI completion over the published port, and stop promptly on SIGTERM. Nothing a
build leaves behind (compilers, pip, pip caches) is in them.

Skips when no Docker daemon answers, or when an image is not built (KASCADE_BUILD_IMAGES=1 builds it
here; the engine's first build downloads ~4 GB of wheels)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.containers, pytest.mark.slow]
RUN_AS_CHART = ["--read-only", "--tmpfs", "/tmp:rw,size=256m", "--user", "65532:65532", "--cap-drop", "ALL",
                "--security-opt", "no-new-privileges"]


def docker(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check, timeout=timeout)


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (hack/docker-up.sh installs docker.io)")
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip("no Docker daemon answers (hack/docker-up.sh starts one)")
    out = subprocess.run(["bash", "hack/build-images.sh", "--list"], cwd=REPO, capture_output=True, text=True,
                         check=True, env={**os.environ, "IMAGES": "operator engine engine-cpu"}).stdout
    return dict(line.split() for line in out.splitlines())


@pytest.fixture(scope="module")
def image(names: dict[str, str]) -> Callable[[str], str]:
    def get(which: str) -> str:
        name = names[which]
        if docker("image", "inspect", name, check=False).returncode != 0:
            if os.environ.get("KASCADE_BUILD_IMAGES") != "1":
                pytest.skip(f"{name} is not built: `make images IMAGES={which}` (or KASCADE_BUILD_IMAGES=1)")
            subprocess.run(["bash", "hack/build-images.sh"], cwd=REPO, check=True, env={**os.environ, "IMAGES": which})
        return name
    return get


def test_operator_image_runs_every_chart_command_read_only_as_65532(image: Callable[[str], str]) -> None:
    name = image("operator")
    cfg = json.loads(docker("image", "inspect", name).stdout)[0]["Config"]
    assert cfg["User"] == "65532:65532" and "HOME=/tmp" in cfg["Env"]
    app_version = yaml.safe_load((REPO / "charts" / "kascade" / "Chart.yaml").read_text())["appVersion"]
    assert cfg["Labels"]["org.opencontainers.image.version"] == app_version
    # the image's own user, no --user: what a pod without runAsUser gets
    assert docker("run", "--rm", name, "id", "-u").stdout.strip() == "65532"
    for argv in (["operator", "run", "--help"], ["router", "--help"], ["probe", "models", "--help"], ["version"]):
        proc = docker("run", "--rm", *RUN_AS_CHART, name, "kascade", *argv, check=False)
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
    # no torch in the operator image (it is the slim one)
    proc = docker("run", "--rm", *RUN_AS_CHART, name, "python3", "-c", "import torch", check=False)
    assert proc.returncode != 0 and "No module named 'torch'" in proc.stderr


@pytest.mark.parametrize("which", ["operator", "engine-cpu", "engine"])
def test_no_build_tools_or_caches_in_the_image(image: Callable[[str], str], which: str) -> None:
    name = image(which)
    script = (
        "for t in gcc cc c++ g++ make ld pip pip3 apt-get; do command -v $t; done; "
        "ls /opt/kascade/bin | grep -E '^pip' ; ls -d /root/.cache /tmp/* /opt/build /src 2>/dev/null; "
        "ls /var/lib/apt/lists | grep -v -E '^(lock|partial|auxfiles)$'; true"
    )
    found = docker("run", "--rm", "--user", "0", "--entrypoint", "sh", name, "-c", script).stdout.split()
    # apt-get stays: it is part of the distribution's base, not of the build
    assert [f for f in found if not f.endswith("/apt-get")] == [], found
    # the build stage's extra CA certificates (a TLS-intercepting proxy's) are not in the image's history
    history = docker("history", "--no-trunc", "--format", "{{.CreatedBy}}", name).stdout
    assert "EXTRA_CA_CERTS" not in history and "BEGIN CERTIFICATE" not in history


def test_cpu_engine_image_is_a_cpu_torch_without_the_cuda_wheels(image: Callable[[str], str]) -> None:
    """hack/torch-cuda-stub.py (ADR 17): libtorch_cuda.so is a stub, the nvidia-* wheels but the CUDA runtime
    and CUPTI are gone (pip agrees), torch computes on the CPU and refuses a CUDA tensor with its own error."""
    name = image("engine-cpu")
    size = json.loads(docker("image", "inspect", name).stdout)[0]["Size"]
    assert size < 2.5e9, f"{name} is {size / 1e9:.2f} GB: the CUDA libraries are back?"
    script = (
        "import importlib.metadata as md, os, pathlib, torch\n"
        "lib = pathlib.Path(torch.__file__).parent / 'lib'\n"
        "print(os.path.getsize(lib / 'libtorch_cuda.so'))\n"
        "print(sorted(d.metadata['Name'] for d in md.distributions() if d.metadata['Name'].startswith('nvidia-')))\n"
        "print(torch.cuda.is_available(), float((torch.ones(4, 4) @ torch.ones(4, 4)).sum()))\n"
        "try:\n"
        "    torch.zeros(1, device='cuda')\n"
        "except RuntimeError as e:\n"
        "    print('raises', 'ATen_cuda' in str(e))\n"
    )
    out = docker("run", "--rm", *RUN_AS_CHART, name, "python", "-c", script).stdout.splitlines()
    assert int(out[0]) < 1 << 20, "libtorch_cuda.so is the real 1 GB library"
    assert out[1] == "['nvidia-cuda-cupti-cu12', 'nvidia-cuda-runtime-cu12']", out[1]
    assert out[2:] == ["False 64.0", "raises True"], out


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kascade_engine.weights.checkpoint import tiny_llama

    root = tmp_path_factory.mktemp("models")
    tiny_llama(root / "tiny-llama")
    for p in [root, *root.rglob("*")]:  # readable by the container's uid 65532, as a volume would be
        p.chmod(0o755 if p.is_dir() else 0o644)
    return root


@pytest.fixture
def container() -> Iterator[list[str]]:
    started: list[str] = []
    yield started
    for cid in started:
        docker("rm", "-f", cid, check=False)


# greedy completions per engine image: the -cpu variant drops only GPU-only libraries, so it must answer
# token for token what the CUDA-wheel image answers on the same CPU
GREEDY: dict[str, str] = {}


@pytest.mark.parametrize("which", ["engine-cpu", "engine"])
def test_engine_image_serves_an_openai_completion_read_only(image: Callable[[str], str], which: str,
                                                             tiny_model: Path, container: list[str]) -> None:
    name = image(which)
    cid = docker("run", "-d", *RUN_AS_CHART, "-v", f"{tiny_model}:/models:ro", "-e", "KASCADE_ENGINE_TOKEN=t0ken",
                 "-p", "127.0.0.1::8000", name, "kascade", "engine", "serve", "--checkpoint=/models/tiny-llama",
                 "--host=0.0.0.0", "--port=8000", "--device=cpu").stdout.strip()
    container.append(cid)
    port = docker("port", cid, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                models = json.load(r)
            break
        except OSError:
            state = json.loads(docker("inspect", cid).stdout)[0]["State"]
            assert state["Running"], docker("logs", cid, check=False).stderr[-3000:]
            assert time.monotonic() < deadline, "engine not up in 180 s: " + docker("logs", cid).stderr[-3000:]
            time.sleep(1)
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]
    body = json.dumps({"model": "tiny-llama", "prompt": "hello world", "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.load(r)
    assert answer["object"] == "text_completion" and answer["model"] == "tiny-llama"
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
    GREEDY[which] = answer["choices"][0]["text"]
    assert len(set(GREEDY.values())) == 1, GREEDY
    # PID 1 in the container: SIGTERM must end it well before Docker's (and the kubelet's) SIGKILL
    t0 = time.monotonic()
    docker("stop", "-t", "20", cid)
    assert time.monotonic() - t0 < 15, "the engine ignored SIGTERM as PID 1"
    assert json.loads(docker("inspect", cid).stdout)[0]["State"]["ExitCode"] in (0, 143)
