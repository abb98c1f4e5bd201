"""Label and annotation keys the operator writes on pods and reads back: the binding record.

A pool pod is idle when it carries `kascade.io/pool=warm` and no `kascade.io/model-service` label;
binding sets `kascade.io/pool=bound`, which takes it out of the pool Deployment's selector (the
ReplicaSet orphans it and starts a fresh idle pod), and unbinding sets `warm` again.
Binding patches both the label and an annotation with the binding generation, guarded by the pod's
resourceVersion, so two operators (or one restarted) can never bind the same pod twice.
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
LIVE = "kascade.io/live"  # annotation "true": loading, and serving live with its pair (route requests to it)
INSTANCE = "kascade.io/instance"  # annotation: engine instance id (defaults to the pod name)
LOADED = "kascade.io/loaded"  # annotation "true": the engine reported every block resident
DRAINING = "kascade.io/draining"  # annotation: time a drain started (scale-down in progress)
UNHEALTHY = "kascade.io/unhealthy"  # annotation: why the engine was dropped (never a scale-up target again)
MANAGED_BY = "app.kubernetes.io/managed-by"
FINALIZER = "kascade.io/finalizer"
