"""A real Prometheus server (built by hack/build-prometheus.sh) scraping local engine processes and the
operator, for the PromQL metric source's e2e and the dashboard's queries.

Data flow: `PrometheusServer(dir).start(jobs, rule_files)` writes prometheus.yml (1 s scrape and rule
evaluation) and starts the binary on a free loopback port -> `/-/ready`. Engine targets come from a
file_sd file that `PodTargets` rewrites from the namespace's pool pods every `period_s`: the
`kascade.io/endpoint` annotation as the address and the labels the chart's PodMonitor relabelling
gives a pod in a cluster (`namespace`, `pod`, `model_service`, `role`, `pool`). `query()` runs PromQL
through the HTTP API the operator uses.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from kascade_devcluster import processes
from kascade_devcluster.binaries import cache_dir
from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.ports import free_ports

log = logging.getLogger(__name__)


class MissingPrometheus(RuntimeError):
    pass


def prometheus_binary() -> Path:
    """$KASCADE_PROMETHEUS or the cache link hack/build-prometheus.sh makes; MissingPrometheus if absent."""
    p = Path(os.environ["KASCADE_PROMETHEUS"]) if os.environ.get("KASCADE_PROMETHEUS") else \
        cache_dir() / "bin" / "prometheus-current" / "prometheus"
    if not p.is_file():
        raise MissingPrometheus(f"prometheus binary missing at {p} (build it with `make install` or "
                                "`bash hack/build-prometheus.sh`)")
    return p


def promtool_binary() -> Path:
    """promtool, built beside prometheus by hack/build-prometheus.sh; MissingPrometheus if absent."""
    p = prometheus_binary().parent / "promtool"
    if not p.is_file():
        raise MissingPrometheus(f"promtool missing at {p} (rebuild with `bash hack/build-prometheus.sh`)")
    return p


class PrometheusServer:
    def __init__(self, directory: Path, binary: Path | None = None) -> None:
        self.dir, self.binary = directory, binary or prometheus_binary()
        self.port = 0
        self.proc: processes.Proc | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, scrape_configs: list[dict[str, Any]], rule_files: Sequence[Path] = (), timeout: float = 30.0,
              interval: str = "1s") -> PrometheusServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.port,) = free_ports(1)
        cfg = {"global": {"scrape_interval": interval, "evaluation_interval": interval, "scrape_timeout": interval},
               "rule_files": [str(p) for p in rule_files], "scrape_configs": scrape_configs}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        argv = [str(self.binary), f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle", "--log.level=warn"]
        self.proc = processes.start("prometheus", argv, self.dir, die_with_parent=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    log.info("prometheus ready at %s", self.url)
                    return self
            except httpx.HTTPError:
                pass
            if not processes.alive(self.proc.pid):
                break
            time.sleep(0.1)
        raise RuntimeError(f"prometheus did not get ready; log:\n{processes.tail(self.proc.log)}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises naming the expression when Prometheus rejects it."""
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        doc = r.json()
        if doc.get("status") != "success":
            raise ValueError(f"query {expr!r}: {doc.get('errorType')}: {doc.get('error')}")
        return list(doc["data"]["result"])

    def api(self, path: str) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", timeout=10)
        r.raise_for_status()
        return r.json()["data"]

    def stop(self) -> None:
        if self.proc is not None:
            processes.stop(self.proc.pid, started=self.proc.started)
            self.proc = None


def pod_targets(cp: ControlPlane, namespace: str) -> list[dict[str, Any]]:
    """file_sd entries for the namespace's engine pods, labelled as the chart's PodMonitor labels them."""
    pods = json.loads(cp.kubectl("-n", namespace, "get", "pods", "-l", "kascade.io/pool", "-o", "json").stdout)["items"]
    out = []
    for p in pods:
        meta = p["metadata"]
        endpoint = (meta.get("annotations") or {}).get("kascade.io/endpoint")
        if not endpoint:
            continue
        labels = meta.get("labels") or {}
        out.append({"targets": [endpoint], "labels": {
            "namespace": namespace, "pod": meta["name"], "model_service": labels.get("kascade.io/model-service", ""),
            "role": labels.get("kascade.io/role", ""), "pool": labels.get("kascade.io/pool", "")}})
    return out


class PodTargets:
    """Keeps a file_sd file in step with the pool pods (what Kubernetes service discovery does)."""

    def __init__(self, cp: ControlPlane, namespace: str, path: Path, period_s: float = 0.5) -> None:
        self.cp, self.ns, self.path, self.period_s = cp, namespace, path, period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> PodTargets:
        self.write()
        self._thread.start()
        return self

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(pod_targets(self.cp, self.ns)))
        tmp.replace(self.path)  # atomic: Prometheus never reads half a file

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.write()
            except Exception as e:  # a transient API error must not end discovery
                log.warning("pod targets: %s", e)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
