"""Label and annotation keys the operator writes on pods and reads back: the binding record.

A pool pod is idle when it carries `kascade.io/pool=warm` and no `kascade.io/model-service` label;
binding sets `kascade.io/pool=bound`, which takes it out of the pool Deployment's selector (the
ReplicaSet orphans it and starts a fresh idle pod), and unbinding sets `warm` again.
The engine is the arbiter of a binding: the operator labels a pod bound only after its engine accepted
the bind (an engine bound to one service refuses every other), and the label patch is guarded by the
pod's resourceVersion. A bound pod carries a controller ownerReference to its ModelService when both
live in one namespace (the pool may live in another namespace: `pool_namespace` setting; then the
annotation `kascade.io/model-service-namespace` names the service's namespace and the operator's
finalizer, not the garbage collector, returns the pod).

Many models, one pool: a pool pod's engine is started for one model architecture, so pool pods carry
the annotation `kascade.io/model` (the `spec.model.name` they can serve); a ModelService only ever
picks pool pods whose annotation equals its model name. A pool pod without the annotation is
model-agnostic (any model may bind it; its engine refuses a model it cannot load, and the operator
drops that target).
"""

from __future__ import annotations

POOL = "kascade.io/pool"  # as a selector: every pool pod, idle or bound
POOL_WARM = "warm"  # idle: what the pool Deployment's selector matches, so it refills when one is bound
POOL_BOUND = "bound"
MODEL_SERVICE = "kascade.io/model-service"
ROLE = "kascade.io/role"
PLAN = "kascade.io/plan"  # annotation: the ScalePlan that bound the pod
ENDPOINT = "kascade.io/endpoint"  # annotation: "host:port" of the engine HTTP server (the harness sets it)
DATA_ENDPOINT = "kascade.io/data-endpoint"  # annotation: "host:port" of the engine data port
ACT_ENDPOINT = "kascade.io/act-endpoint"  # annotation: "host:port" where the engine finishes split requests
CONVERTIBLE = "kascade.io/convertible"  # annotation "true": a decode engine converted to take prefill (PD burst)
LIVE = "kascade.io/live"  # annotation "true": loading, and serving live with its pair (route requests to it)
INSTANCE = "kascade.io/instance"  # annotation: engine instance id (defaults to the pod name)
LOADED = "kascade.io/loaded"  # annotation "true": the engine reported every block resident
DRAINING = "kascade.io/draining"  # annotation: time a drain started (scale-down in progress)
SERVING_GATE = "kascade.io/serving"  # pod readiness gate / condition: open while bound and loaded or live
UNHEALTHY = "kascade.io/unhealthy"  # annotation: why the engine was dropped (never a scale-up target again)
ENGINE_TP = "kascade.io/engine-tp"  # annotation on tensor-parallel engine pods: their --tp (absent: 1)
ENGINE_CAPACITY = "kascade.io/engine-capacity"  # annotation on pool pods: their engine's capacity flags (capacity.py)
MODEL = "kascade.io/model"  # annotation on pool pods: the spec.model.name their engine serves (absent: any)
SERVICE_NS = "kascade.io/model-service-namespace"  # annotation: the bound service's namespace (pool elsewhere)
HOST_COPY = "kascade.io/host-copy"  # annotation on a pool pod: the spec.model.name its engine keeps in host
# memory (a host source and the fastest scale from zero); set at release, kept at a bind from it, set when a
# serving engine keeps one on request (hostcopykeeper.py), cleared at any other bind
HOST_COPY_REFUSED = "kascade.io/host-copy-refused"  # annotation: the model whose host copy this pod's engine
# declined to keep (no or too small --host-cache-gib): never asked again for that model (the Event says why)
PREEMPTED_FOR = "kascade.io/preempted-for"  # annotation on a draining pod: the arbitration entry (fleetboard.py)
# it was preempted for; the taker counts it as coming while it drains, nobody else is granted it
CREATED_FOR = "kascade.io/created-for"  # annotation: "ns/name" of the service a fallback pod was created for
MANAGED_BY = "app.kubernetes.io/managed-by"
# GPU Feature Discovery's node labels: the node class of the pool's engines (fleettargets.py)
GPU_PRODUCT = "nvidia.com/gpu.product"  # the GPU type, e.g. NVIDIA-H100-80GB-HBM3
GPU_MEMORY = "nvidia.com/gpu.memory"  # memory per GPU in MiB
FINALIZER = "kascade.io/finalizer"
