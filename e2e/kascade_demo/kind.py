"""`kascade demo-kind` (`make demo-kind`): the demo's story as a user runs Kascade, on a kind cluster built
here: the chart installs its own Deployments (the operator with two replicas and leader election, two
routers, the warm pool of engine pods) from our images, a ModelService is applied, a burst of requests goes
through the router's Service, and the scale-up by chain and the scale-down show as they happen.

Data flow: `KindDemo.run()` -> `KindCluster` (create or reuse, fake GPUs and leaf labels, our images into
the nodes) -> `helm upgrade --install` (e2e/kind/values.yaml with our image names; the pool's engines pace
their weight sends with pool.extraArgs so each hop is visible) in a namespace Pod Security `restricted`
enforces -> ModelService applied -> `kubectl port-forward` to the router's Service -> `LoadGen` phases
(steady, burst, calm) observed into the demo's `Timeline` (scenario.Demo.observe) -> `kubectl get
msvc,splan`, a summary and a plot -> the port-forward stopped; the cluster is kept, and how to remove it
is printed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from kascade_demo.kindcluster import REPO, KindCluster, image_present, missing, tiny_model
from kascade_demo.scenario import Demo, DemoConfig, DemoResult, ModelChoice
from kascade_devcluster.loadgen import LoadGen
from kascade_devcluster.waiting import wait_for

log = logging.getLogger(__name__)
NS = "kascade"  # e2e/kind/models-pv.yaml binds the model volume's claim in this namespace
# the kind nodes share this machine's cores: thresholds of a CPU engine there, and weights paced at 30 Mbit/s
# so a hop of the tiny model takes a few seconds (the timeline polls the API every ~0.5-1 s)
KIND_MODEL = ModelChoice("tiny-kind", 8, upper=150, lower=40, transfer_mbps=30)


def _chart_tag() -> str:
    m = re.search(r'^appVersion:\s*"?([^"\s]+)', (REPO / "charts" / "kascade" / "Chart.yaml").read_text(), re.M)
    if not m:
        raise RuntimeError("no appVersion in charts/kascade/Chart.yaml")
    return m.group(1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KindDemo(Demo):
    def __init__(self, cfg: DemoConfig, cluster: str = "kascade-demo") -> None:
        super().__init__(cfg)
        self.m, self.ns = KIND_MODEL, NS
        tag = _chart_tag()  # what `make images` tags; the kind e2e's variables pick others (tests/kind)
        self.operator_image = os.environ.get("KASCADE_KIND_OPERATOR_IMAGE", f"ghcr.io/kascade/kascade-operator:{tag}")
        self.engine_image = os.environ.get("KASCADE_KIND_ENGINE_IMAGE", f"ghcr.io/kascade/kascade-engine:{tag}-cpu")
        self.kind = KindCluster(cluster, cfg.out.resolve() / "kubeconfig")
        self.forward: subprocess.Popen[str] | None = None

    def kubectl(self, *args: str) -> str:
        return self.kind.kubectl(*args)

    def run(self) -> DemoResult:
        cfg, k = self.cfg, self.kind
        need = missing() + [f"image {i} (make images)" for i in (self.operator_image, self.engine_image)
                            if not image_present(i)]
        if need:
            raise RuntimeError("not built yet: " + "; ".join(need) + " (make demo-kind builds them)")
        try:
            self.step(f"1/7 kind cluster '{k.name}': one control plane, two workers (node image built here)")
            created = k.create()
            self.step(f"    {'created' if created else 'reused'}; kubeconfig {k.kubeconfig}")
            self.step("2/7 workers: 4 fake GPUs each (extended resource nvidia.com/gpu), leaf labels")
            leaf_of = k.label_workers()
            engine_node = k.workers()[0]
            tiny_model()
            self.step(f"3/7 images into the nodes: {self.operator_image} on both workers, {self.engine_image} "
                      f"on {engine_node} (the pool runs there; minutes the first time)")
            for image, node in [(self.operator_image, n) for n in k.workers()] + [(self.engine_image, engine_node)]:
                t0 = time.monotonic()
                k.load(image, node)
                self.step(f"    {image} on {node}: {time.monotonic() - t0:.0f} s")
            self.step(f"4/7 helm upgrade --install kascade: operator x2 (leader election), router x2, warm pool x3, "
                      f"in namespace {NS} (Pod Security restricted)")
            self.install_release(engine_node)
            self.step(f"5/7 kubectl apply ModelService '{self.service}' (min 1, max 3, threshold "
                      f"{self.m.lower:g}..{self.m.upper:g} tokens/s per replica, chain multicast, live)")
            k.kubectl("-n", NS, "apply", "-f", "-", input=json.dumps(self.modelservice(str(tiny_model()))))
            url = self.port_forward()
            self.step(f"    router Service: kubectl -n {NS} port-forward svc/kascade-router -> {url}/v1")
            self.gen = LoadGen(url, self.m.name, list(range(3, 3 + self.m.prompt_tokens)), max_tokens=8,
                               timeout_s=180).start(cfg.burst_workers)
            self.step("6/7 the first copy, from the model volume into a pool pod")
            self.watch_until(lambda: self.ready_count() >= 1, 300, leaf_of, "the first copy")
            self.step("7/7 load through the router: steady, then a burst, then calm")
            self.phases(leaf_of)
            return self.finish(cfg.out.resolve())
        finally:
            self.teardown()
            self.console.print(
                f"\n[bold]The cluster is still up.[/bold] Look around:\n"
                f"  export KUBECONFIG={k.kubeconfig}\n"
                f"  {k.bins}/kubectl -n {NS} get msvc,splan,pods -o wide\n"
                f"Clean up: helm uninstall first (its hook removes the ModelService's finalizer), then the cluster:\n"
                f"  {k.bins}/helm --kubeconfig {k.kubeconfig} uninstall kascade -n {NS}\n"
                f"  {Path.home()}/.cache/kascade/kind/bin/kind delete cluster --name {k.name}")

    def install_release(self, engine_node: str) -> None:
        k = self.kind
        k.kubectl("create", "namespace", NS, check=False)
        k.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted",
                  "pod-security.kubernetes.io/enforce-version=latest", "--overwrite")
        k.kubectl("apply", "-f", str(REPO / "e2e" / "kind" / "models-pv.yaml"))
        t0 = time.monotonic()
        k.helm("upgrade", "--install", "kascade", *self.chart_args(engine_node), "--wait", "--timeout=600s")
        self.step(f"    installed; every Deployment available in {time.monotonic() - t0:.0f} s")
        self.step("    " + k.kubectl("-n", NS, "get", "deploy").strip().replace("\n", "\n" + " " * 12))

    def chart_args(self, engine_node: str) -> list[str]:
        """The chart, its namespace and values: e2e/kind/values.yaml with our images, the pool on the node
        that has the engine image, its engines pacing their weight sends."""
        orepo, _, otag = self.operator_image.rpartition(":")
        erepo, _, etag = self.engine_image.rpartition(":")
        return [str(REPO / "charts" / "kascade"), "-n", NS, "-f", str(REPO / "e2e" / "kind" / "values.yaml"),
                "--set", f"image.repository={orepo},image.tag={otag},pool.image.repository={erepo}",
                "--set", f"pool.image.tag={etag},pool.model.name={self.m.name},pool.model.path=/models/{self.m.name}",
                "--set", f"pool.nodeSelector.kubernetes\\.io/hostname={engine_node}",
                "--set-json", f'pool.extraArgs=["--transfer-max-mbps={self.m.transfer_mbps:g}"]']

    def modelservice(self, path: str) -> dict[str, Any]:
        ms = super().modelservice(path)
        spec = ms["spec"]
        spec["model"]["source"] = {"path": f"/models/{self.m.name}"}  # in the pods, not on this host
        spec["engine"] = {"image": self.engine_image, "tp": 1, "resources": {"limits": {"nvidia.com/gpu": 1}}}
        spec["replicas"] = {"colocated": {"min": 1, "max": 3}}
        return ms

    def port_forward(self) -> str:
        port = _free_port()
        k = self.kind
        self.forward = subprocess.Popen(
            [str(k.bins / "kubectl"), f"--kubeconfig={k.kubeconfig}", "-n", NS, "port-forward", "svc/kascade-router",
             f"{port}:8080"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, 60, "kubectl port-forward to the router's Service")
        return f"http://127.0.0.1:{port}"

    def teardown(self) -> None:
        if self.gen is not None:
            self.gen.stop()
        if self.forward is not None:
            self.forward.terminate()
            self.forward.wait(10)
