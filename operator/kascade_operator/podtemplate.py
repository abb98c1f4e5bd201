"""The engine pod the operator creates when the warm pool is short (the slow path), and the policy that
decides whether it may create it at all.

Least privilege for ModelService authors: whoever may create a ModelService must not get, through the
operator, a pod the installation would not run. So a fallback pod is created only when
- its image is the installation's engine image (`engine_image`) or on the allowlist (`allowed_images`;
  an entry ending in `*` is a prefix), and
- a `path` / `file://` source lies under a host-path root the installation allows
  (`allowed_host_path_roots`; none by default, so no hostPath at all unless the chart says so).
Only such pods get the engine token (from the installation's Secret). Otherwise the operator refuses,
and the service's `Stalled` condition names the field. A `pvc` source mounts the claim read-only
(claims are namespaced: it must live in the pool's namespace). An `hf://` source mounts nothing of
the node: the engine downloads the snapshot (HF_ENDPOINT and the HF_TOKEN Secret are the installation's
settings, never the ModelService author's). With the installation's data-plane TLS Secret
(`engine_tls_secret`: tls.crt, tls.key, ca.crt) the pod mounts it at `TLS_MOUNT` and serves with
`--tls-cert/--tls-key/--tls-ca`, exactly as the chart's pool pods do, so it can talk to them. Like the
chart's pool pods it runs as the non-root engine user (`engine_run_as_user`) with the security context
Pod Security `restricted` requires (read-only root, a private /tmp), so a namespace enforcing `baseline`
or `restricted` admits it unless its source is a hostPath (which `baseline` forbids: use pvc or hf://).

Data flow: ModelServiceSpec + OperatorSettings -> `refusals()` (field: problem) -> `fallback_pod()`
(a warm-pool pod annotated for the model and for this service, owned by it when in its namespace).
`checkpoint_path()` is the directory the engine loads the first copy from (sent with `bind`).
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import Any

from kascade_operator import capacity
from kascade_operator import labels as L
from kascade_operator.api import ModelServiceSpec
from kascade_operator.settings import AF41, OperatorSettings

PVC_MOUNT = "/kascade/model"  # where a fallback pod mounts a pvc source (or an hf:// source's config)
HF_HOME = "/kascade/hf"  # a fallback pod's Hub cache (emptyDir) for hf:// sources
ACT_PORT = 18516
TLS_MOUNT = "/etc/kascade/tls"  # the data-plane TLS Secret in engine pods (the chart's pool mounts it here too)
TLS_FILES = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}  # flag -> key (cert-manager's Secret layout)


INIT_RESOURCES = {"requests": {"cpu": "100m", "memory": "256Mi"},
                  "limits": {"cpu": "1", "memory": "1Gi"}}  # the config+tokenizer download of an hf:// source
CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}  # what the chart's containers have (restricted profile)


def pod_security(uid: int) -> dict[str, Any]:
    """The pod securityContext of the chart's pool pods, for the fallback pods."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def tls_args() -> list[str]:
    """`kascade engine serve` flags reading the mounted data-plane TLS Secret."""
    return [f"--tls-{flag}={TLS_MOUNT}/{key}" for flag, key in TLS_FILES.items()]


def host_path(spec: ModelServiceSpec) -> str | None:
    """The host directory a path or file:// source names (None for pvc)."""
    src = spec.model.source
    if src.path:
        return src.path
    if src.uri and src.uri.startswith("file://"):
        return src.uri[len("file://"):] or "/"
    return None


def hub_uri(spec: ModelServiceSpec) -> str | None:
    """The `hf://` URI of a Hub source (None otherwise): the bound engine downloads it itself."""
    uri = spec.model.source.uri
    return uri if uri and uri.startswith("hf://") else None


def checkpoint_path(spec: ModelServiceSpec) -> str:
    """Where an engine reads the first copy from (sent with `bind`): the host path, the claim's mount
    point, or the `hf://` URI (the engine resolves it to a downloaded snapshot, modelsource.py)."""
    hp = host_path(spec)
    if hp is not None:
        return hp
    return hub_uri(spec) or PVC_MOUNT


def _under(path: str, root: str) -> bool:
    p, r = posixpath.normpath(path), posixpath.normpath(root)
    return r == "/" or p == r or p.startswith(r.rstrip("/") + "/")


def image_allowed(image: str, settings: OperatorSettings) -> bool:
    allowed = [x for x in (settings.engine_image, *settings.allowed_images) if x]
    return any(image.startswith(a[:-1]) if a.endswith("*") else image == a for a in allowed)


def refusals(spec: ModelServiceSpec, settings: OperatorSettings) -> list[str]:
    """Why the operator must not create an engine pod for this spec ("field: problem"), empty if it may."""
    out: list[str] = []
    if not image_allowed(spec.engine.image, settings):
        allowed = [x for x in (settings.engine_image, *settings.allowed_images) if x]
        out.append(f"spec.engine.image: {spec.engine.image!r} is not the installation's engine image nor on its "
                   f"allowlist ({', '.join(allowed) or 'none configured'}); the operator creates no pod with it")
    hp = host_path(spec)
    field = "spec.model.source.path" if spec.model.source.path else "spec.model.source.uri"
    if hp is not None:
        if ".." in hp.split("/"):
            out.append(f"{field}: {hp!r} must not contain '..'")
        elif not any(_under(hp, r) for r in settings.allowed_host_path_roots):
            roots = ", ".join(settings.allowed_host_path_roots) or "none"
            out.append(f"{field}: hostPath {hp!r} is not under a root the installation allows ({roots}); "
                       f"the operator mounts no such hostPath")
    if spec.engine.tp > 1 and settings.engine_tls_secret:
        out.append(f"spec.engine.tp: {spec.engine.tp} ranks load their planes over plain TCP, and this installation "
                   "runs the data plane over TLS (engineTlsSecret); tensor-parallel pods are not created with it")
    if spec.engine.tp > 1 and spec.engine.data_port + spec.engine.tp - 1 > 65535:
        out.append(f"spec.engine.dataPort: {spec.engine.data_port} + tp {spec.engine.tp} - 1 exceeds 65535 "
                   "(rank r listens on dataPort + r)")
    return out


def _hub_env(hf_endpoint: str, hf_token_secret: str) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "HF_HOME", "value": HF_HOME}]
    if hf_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": hf_endpoint})
    if hf_token_secret:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": hf_token_secret, "key": "token"}}})
    return env


def fallback_pod(spec: ModelServiceSpec, key: str, token_secret: str, owner: Mapping[str, Any] | None,
                 act_port: int = ACT_PORT, hf_endpoint: str = "", hf_token_secret: str = "",
                 log_format: str = "text", tls_secret: str = "", run_as_user: int = 65532,
                 transport: str = "tcp", ucx_tcp_ports: str = "", activation_dscp: int = AF41,
                 host_cache_gib: float = 0.0, installation_capacity: Mapping[str, int] | None = None,
                 dtype: str = "auto", default_resources: Mapping[str, Any] | None = None,
                 gpu_resource: str = "nvidia.com/gpu", require_prefill_signature: bool = False,
                 extra_args: tuple[str, ...] | list[str] = ()) -> dict[str, Any]:
    """A new warm-pool engine pod for this model, reserved for service `key` (annotation created-for):
    it joins the pool and is bound in a later round like any pool pod. Call only when `refusals()` is
    empty. An `hf://` source: an init container fetches config and tokenizer (what an empty engine is
    started with) into an emptyDir; the weights are downloaded by the engine when bound (HF_ENDPOINT,
    HF_TOKEN from the installation's Secret, cache in another emptyDir). `tls_secret`: mount it and serve the
    data plane over mutual TLS (empty: plain TCP, as the pool without TLS). `transport`: the engine's
    --transport, the pool's (peers reach only engines that speak theirs); with ucx, `ucx_tcp_ports` is
    UCX_TCP_PORT_RANGE, the range the pool's NetworkPolicy admits. `activation_dscp`: the engine's
    --activation-dscp, the pool's (0: its activation connections and HTTP answers go unmarked).
    `host_cache_gib`: the engine's --host-cache-gib, the pool's (a service on fallback pods keeps its host copy
    too; 0: it keeps none). Capacity flags: spec.engine.capacity over `installation_capacity` (the pool's),
    annotated like pool pods (capacity.py); `dtype`: the pool's --dtype (spec.model.dtype still wins at bind).
    `default_resources`: the pool's container resources, for a spec without spec.engine.resources (with
    spec.engine.tp g > 1 its `gpu_resource` count becomes g). spec.engine.tp g > 1: the engine runs g ranks
    (`--tp g`), rank r receiving its plane on dataPort + r (ports data-r1..), the act port past them.
    `require_prefill_signature`: the engine's --require-prefill-signature, the pool's (it dials only prefill
    peers a router signed; False: any peer a request names). `extra_args`: further engine flags after these,
    the pool's pool.extraArgs (settings.ENGINE_MANAGED_FLAGS refused there)."""
    e, src = spec.engine, spec.model.source
    if e.data_port <= act_port < e.data_port + e.tp:  # rank r's data port is dataPort + r: the act port moves past
        act_port = e.data_port + e.tp
    cap = capacity.effective(e.capacity, installation_capacity or {})
    ckpt = checkpoint_path(spec)
    hub = hub_uri(spec)
    init: list[dict[str, Any]] = []
    extra_volumes: list[dict[str, Any]] = []
    volume: dict[str, Any]
    mount: dict[str, Any]
    if hub is not None:
        repo, _, rev = hub[len("hf://"):].partition("@")
        ckpt = PVC_MOUNT  # the engine's --checkpoint: config + tokenizer only
        volume = {"name": "model", "emptyDir": {}}
        mount = {"name": "model", "mountPath": PVC_MOUNT}
        cache = {"name": "hf-cache", "mountPath": HF_HOME}
        extra_volumes.append({"name": "hf-cache", "emptyDir": {}})
        init.append(
            {
                "name": "model-config",
                "image": e.image,
                "args": [
                    "kascade",
                    "model",
                    "download",
                    repo,
                    f"--revision={rev or 'main'}",
                    f"--dest={PVC_MOUNT}",
                    "--config-only",
                ],
                "env": [
                    {"name": "KASCADE_LOG_FORMAT", "value": log_format},
                    {"name": "HOME", "value": "/tmp"},
                    *_hub_env(hf_endpoint, hf_token_secret),
                ],
                "resources": dict(INIT_RESOURCES),
                "securityContext": dict(CONTAINER_SECURITY),
                "volumeMounts": [mount, cache, {"name": "tmp", "mountPath": "/tmp"}],
            }
        )
    elif src.pvc is not None:
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": src.pvc.claim_name, "readOnly": True}}
        mount = {"name": "model", "mountPath": PVC_MOUNT, "readOnly": True}
        if src.pvc.sub_path:
            mount["subPath"] = src.pvc.sub_path
    else:
        volume = {"name": "model", "hostPath": {"path": ckpt, "type": "Directory"}}
        mount = {"name": "model", "mountPath": ckpt, "readOnly": True}
    env: list[dict[str, Any]] = [{"name": "KASCADE_ENGINE_TOKEN",
                                  "valueFrom": {"secretKeyRef": {"name": token_secret, "key": "token"}}},
                                 {"name": "KASCADE_LOG_FORMAT", "value": log_format},  # as the installation's pods
                                 {"name": "HOME", "value": "/tmp"}]  # the root filesystem is read-only
    if transport == "ucx" and ucx_tcp_ports:
        env.append({"name": "UCX_TCP_PORT_RANGE", "value": ucx_tcp_ports})  # UCX's own listeners, as the pool's
    mounts = [mount, {"name": "tmp", "mountPath": "/tmp"}]
    if hub is not None:
        env += _hub_env(hf_endpoint, hf_token_secret)
        mounts.append({"name": "hf-cache", "mountPath": HF_HOME})
    # with TLS files the engine's HTTP port is HTTPS (kubelet does not verify the certificate of an HTTPS probe)
    scheme = {"scheme": "HTTPS"} if tls_secret else {}

    def probe(path: str) -> dict[str, Any]:
        return {"path": path, "port": "http", **scheme}

    container: dict[str, Any] = {
        "name": "engine",
        "image": e.image,
        "args": [
            "kascade",
            "engine",
            "serve",
            "--empty",
            "--host=0.0.0.0",
            f"--port={e.port}",
            f"--act-port={act_port}",
            f"--transport={transport}",
            f"--activation-dscp={activation_dscp}",
            f"--host-cache-gib={host_cache_gib:g}",
            f"--checkpoint={ckpt}",
            f"--model-name={spec.model.name}",
            *capacity.args(cap),
            f"--dtype={dtype}",
            *([f"--tp={e.tp}"] if e.tp > 1 else []),  # rank r of the instance receives its plane on data port + r
            *(["--require-prefill-signature"] if require_prefill_signature else []),
            *(tls_args() if tls_secret else []),
            *extra_args,
        ],
        "env": env,
        "ports": [
            {"containerPort": e.port, "name": "http"},
            {"containerPort": e.data_port, "name": "data"},
            *({"containerPort": e.data_port + r, "name": f"data-r{r}"} for r in range(1, e.tp)),
            {"containerPort": act_port, "name": "act"},
        ],
        # Ready only while the engine can serve (/readyz) and the operator's serving gate is open (bound and
        # loaded or live, not draining): a fallback pod belongs to no Deployment, so no availability waits
        # on it (the chart's pool pods are Ready when healthy and select serving by label instead)
        "readinessProbe": {"httpGet": probe("/readyz"), "periodSeconds": 1, "failureThreshold": 1},
        "livenessProbe": {"httpGet": probe("/healthz"), "periodSeconds": 10},
        # started only once the engine's HTTP server answers: the operator binds started pods only
        "startupProbe": {"httpGet": probe("/healthz"), "periodSeconds": 1, "failureThreshold": 600},
        "securityContext": dict(CONTAINER_SECURITY),
        "volumeMounts": mounts,
        # an engine that exits on a refused flag (a tp that does not divide the heads) says why on stderr: the
        # kubelet keeps that tail in the pod's status, and the operator puts it in the ModelService's conditions
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if tls_secret:
        mounts.append({"name": "data-plane-tls", "mountPath": TLS_MOUNT, "readOnly": True})
        extra_volumes.append({"name": "data-plane-tls", "secret": {"secretName": tls_secret}})
    if e.resources:
        container["resources"] = e.resources.model_dump(exclude_none=True)
    elif default_resources:
        container["resources"] = {k: dict(v) for k, v in default_resources.items()}
        if e.tp > 1:  # the pool's pods ask for GPUs: a TP-g pod asks for g (one per rank); CPU pools ask for none
            for part in container["resources"].values():
                if gpu_resource in part:
                    part[gpu_resource] = e.tp
    meta: dict[str, Any] = {"generateName": "kascade-fallback-",
                            "labels": {L.POOL: L.POOL_WARM, L.MANAGED_BY: "kascade"},
                            "annotations": {L.MODEL: spec.model.name, L.CREATED_FOR: key}}
    if cap:
        meta["annotations"][L.ENGINE_CAPACITY] = capacity.annotation(cap)
    if e.tp > 1:  # only services of this tp bind it (pool.can_serve); pods without the annotation run tp 1
        meta["annotations"][L.ENGINE_TP] = str(e.tp)
    if owner is not None:
        meta["ownerReferences"] = [dict(owner)]
    pod: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta,
                           "spec": {"containers": [container], "automountServiceAccountToken": False,
                                    # no Service environment variables: KASCADE_* ones could reach settings
                                    "enableServiceLinks": False,
                                    "securityContext": pod_security(run_as_user),
                                    "readinessGates": [{"conditionType": L.SERVING_GATE}],
                                    "volumes": [volume, {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
                                                *extra_volumes]}}
    if init:
        pod["spec"]["initContainers"] = init
    if e.node_selector:
        pod["spec"]["nodeSelector"] = dict(e.node_selector)
    if e.tolerations:
        pod["spec"]["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in e.tolerations]
    return pod
