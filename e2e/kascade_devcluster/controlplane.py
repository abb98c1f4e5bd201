"""A local Kubernetes control plane: etcd -> kube-apiserver -> (kube-controller-manager,
kube-scheduler, kwok), all plain processes on 127.0.0.1 ports picked at start.

Data flow: `ControlPlane.start()` makes the PKI, starts each component, waits for readiness, writes a
kubeconfig and a state file; `ControlPlane.load(state_dir)` reattaches from that file in another process
(`kascade cluster down`); `stop()` stops components in reverse order by PID.
"""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kascade_devcluster import processes
from kascade_devcluster.binaries import bin_dir as find_bin_dir
from kascade_devcluster.binaries import cache_dir
from kascade_devcluster.kubeconfig import kubeconfig_text
from kascade_devcluster.pki import make_pki
from kascade_devcluster.ports import free_ports

log = logging.getLogger(__name__)
STATE_FILE = "state.json"


class StateError(RuntimeError):
    pass


TOOL_TIMEOUT_S = 120.0  # a kubectl or helm call's limit unless its caller gives another


class ToolError(RuntimeError):
    """kubectl or helm failed; the message carries its stderr."""


@dataclass
class ControlPlane:
    state_dir: Path
    bin_dir: Path
    api_port: int = 0
    token: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    # Kernel start time per component: with the PID it identifies the process (PIDs get reused).
    starts: dict[str, int] = field(default_factory=dict)
    _detachable: bool = field(default=False, repr=False, compare=False)

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    @property
    def ca_cert(self) -> Path:
        return self.state_dir / "pki" / "ca.crt"

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def create(cls, state_dir: Path | None = None, bin_dir: Path | None = None) -> ControlPlane:
        return cls(state_dir or default_state_dir(), bin_dir or find_bin_dir())

    def start(self, scheduling: bool = True, kwok: bool = True, timeout: float = 60.0,
              detachable: bool = False, node_grace_s: int = 40, node_lease_s: int = 40) -> ControlPlane:
        """Start and wait until ready. Unless `detachable`, the components die with this interpreter
        even when it is killed (tests); `kascade cluster up` passes True and then calls detach().
        `node_grace_s`: how long a node's heartbeat may be missing before the node controller marks it
        and its pods NotReady (a benchmark with thousands of KWOK nodes on a loaded machine raises it).
        `node_lease_s`: KWOK's node Lease duration; it renews each node's Lease every quarter of it (as a
        kubelet does), so 40 s (the kubelet default) is 10,000 nodes x 1 write / 10 s = 1,000 Lease writes per
        second on the API server. A fleet-scale benchmark relaxes it and says so; its renewal period must stay
        below `node_grace_s` or the node controller marks the nodes NotReady between two renewals."""
        if node_lease_s < 1 or node_lease_s / 4 >= node_grace_s:
            raise ValueError(f"node_lease_s ({node_lease_s}): needs >= 1 and its renewal period (a quarter) below "
                             f"node_grace_s ({node_grace_s}), or the node controller marks nodes NotReady "
                             "between two renewals")
        t0 = time.monotonic()
        self._detachable = detachable
        if (self.state_dir / STATE_FILE).exists():
            self._clear_stale_state()
        for sub in ("etcd", "logs"):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        pki = make_pki(self.state_dir / "pki")
        self.token = pki.admin_token
        etcd_port, peer_port, self.api_port, kwok_port = free_ports(4)
        logs = self.state_dir / "logs"
        b = self.bin_dir
        try:
            self._spawn("etcd", [
                str(b / "etcd"), "--name=default", f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync", "--log-level=warn", "--listen-metrics-urls=",
            ], logs)
            self._wait("etcd", lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"), timeout)
            self._spawn("kube-apiserver", [
                str(b / "kube-apiserver"), f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
                f"--tls-cert-file={pki.server_cert}", f"--tls-private-key-file={pki.server_key}",
                f"--client-ca-file={pki.ca_cert}", f"--token-auth-file={pki.tokens_csv}",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}", f"--service-account-signing-key-file={pki.sa_key}",
                "--service-cluster-ip-range=10.96.0.0/16", "--allow-privileged=true",
                # As envtest does: no ServiceAccount admission, so pods need no token volume.
                "--disable-admission-plugins=ServiceAccount", "--v=0",
            ], logs)
            self._wait("kube-apiserver", lambda: _http_ok(f"{self.api_url}/readyz", self.token, pki.ca_cert), timeout)
            self.kubeconfig.write_text(kubeconfig_text(self.api_url, pki.ca_cert, self.token))
            self.kubeconfig.chmod(0o600)
            if scheduling:
                self._spawn("kube-controller-manager", [
                    str(b / "kube-controller-manager"), f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}",
                    "--leader-elect=false", "--secure-port=0",
                    f"--service-account-private-key-file={pki.sa_key}", f"--root-ca-file={pki.ca_cert}",
                    "--use-service-account-credentials=false",
                    "--controllers=*,-nodeipam,-cloud-node-lifecycle,-serviceaccount-token",
                    "--concurrent-deployment-syncs=10", f"--node-monitor-grace-period={node_grace_s}s",
                ], logs)
                self._spawn("kube-scheduler", [
                    str(b / "kube-scheduler"), f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}", f"--authorization-kubeconfig={self.kubeconfig}",
                    "--leader-elect=false", "--secure-port=0",
                ], logs)
            if kwok:
                self._spawn("kwok", [
                    str(b / "kwok"), f"--kubeconfig={self.kubeconfig}", f"--config={b / 'kwok-stages.yaml'}",
                    "--manage-all-nodes=false", "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                    f"--node-lease-duration-seconds={node_lease_s}", f"--server-address=127.0.0.1:{kwok_port}",
                    "--cidr=10.0.0.1/16", "--node-ip=10.0.0.1",
                ], logs)
                self._wait("kwok", lambda: _http_ok(f"http://127.0.0.1:{kwok_port}/healthz"), timeout)
            # kcm and the scheduler serve no health port here (--secure-port=0): at least catch a crash
            # at start (bad flag, apiserver refused) instead of hanging the first test that needs them.
            for name in self.pids:
                self._wait(name, lambda: True, timeout)
            self.save()
        except BaseException:
            self.stop()
            raise
        log.info("control plane ready at %s in %.1f s (kubeconfig %s)", self.api_url, time.monotonic() - t0,
                 self.kubeconfig)
        return self

    def stop(self) -> None:
        # Reverse start order: clients first, then the apiserver, etcd last.
        for name in ("kwok", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            pid = self.pids.pop(name, None)
            if pid is not None:
                processes.stop(pid, started=self.starts.pop(name, None))
        (self.state_dir / STATE_FILE).unlink(missing_ok=True)

    def detach(self) -> None:
        """Keep the components running after this process exits (`kascade cluster up`)."""
        if not self._detachable:
            raise RuntimeError("started with detachable=False: the components die with this process")
        for pid in self.pids.values():
            processes.detach(pid)

    def _clear_stale_state(self) -> None:
        try:
            old = ControlPlane.load(self.state_dir)
        except StateError as e:
            raise StateError(f"{e}; remove it to start afresh") from None
        if any(old.running().values()):
            raise StateError(f"{self.state_dir / STATE_FILE}: a control plane is running "
                             "(stop it with `kascade cluster down`)")
        log.info("removing stale state of a stopped control plane")
        (self.state_dir / STATE_FILE).unlink()

    # -- state file ------------------------------------------------------------------------
    def save(self) -> None:
        data = {**asdict(self), "state_dir": str(self.state_dir), "bin_dir": str(self.bin_dir)}
        data.pop("_detachable")
        (self.state_dir / STATE_FILE).write_text(json.dumps(data, indent=2))

    @classmethod
    def load(cls, state_dir: Path | None = None) -> ControlPlane:
        path = (state_dir or default_state_dir()) / STATE_FILE
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise StateError(f"{path}: no control plane state (is one running? `kascade cluster up`)") from None
        except json.JSONDecodeError as e:
            raise StateError(f"{path}: not valid JSON ({e}); remove it after stopping stray processes") from None
        try:
            pids = {str(k): int(v) for k, v in data["pids"].items()}
            starts = {str(k): int(v) for k, v in data.get("starts", {}).items()}
            return cls(Path(data["state_dir"]), Path(data["bin_dir"]), int(data["api_port"]), str(data["token"]),
                       pids, starts)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StateError(f"{path}: malformed state, field {e!s}") from None

    # -- tools -----------------------------------------------------------------------------
    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = TOOL_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        return self._tool("kubectl", args, check, input, timeout)

    def kubectl_stream(self, *args: str) -> subprocess.Popen[str]:
        """kubectl left running (`get -w`), its stdout a pipe of text; the caller ends it."""
        return subprocess.Popen(self._argv("kubectl", args), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self._tool("helm", args, check, None, TOOL_TIMEOUT_S)

    def running(self) -> dict[str, bool]:
        return {n: processes.alive(p, self.starts.get(n)) for n, p in self.pids.items()}

    def _argv(self, tool: str, args: tuple[str, ...]) -> list[str]:
        return [str(self.bin_dir / tool), f"--kubeconfig={self.kubeconfig}", *args]

    def _tool(
        self, tool: str, args: tuple[str, ...], check: bool, input: str | None, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            self._argv(tool, args),
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ToolError(
                f"{tool} {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def _spawn(self, name: str, argv: list[str], logs: Path) -> None:
        proc = processes.start(name, argv, logs, die_with_parent=not self._detachable)
        self.pids[name] = proc.pid
        if proc.started is not None:
            self.starts[name] = proc.started

    def _wait(self, name: str, ready: object, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not processes.alive(self.pids[name]):
                raise RuntimeError(
                    f"{name} exited during start-up:\n{processes.tail(self.state_dir / 'logs' / f'{name}.log')}"
                )
            if ready():  # type: ignore[operator]
                return
            time.sleep(0.1)
        raise TimeoutError(
            f"{name} not ready after {timeout:.0f} s:\n{processes.tail(self.state_dir / 'logs' / f'{name}.log')}"
        )


def default_state_dir() -> Path:
    return cache_dir() / "cluster"


def _http_ok(url: str, token: str | None = None, ca: Path | None = None) -> bool:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False
