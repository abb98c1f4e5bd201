"""The chart's router: a read-only watcher behind a Service, its API keys from a Secret (rendered by `helm
template`, no cluster)."""

from __future__ import annotations

from images import Helm, rendered


def test_router_is_a_read_only_watcher_behind_a_service(helm: Helm) -> None:
    docs = rendered(helm, "-n", "ns", "--set", "router.enabled=true", "--set", "router.replicas=3",
                    "--set", "router.inferencePool.pools[0].modelService=chat",
                    "--api-versions", "inference.networking.k8s.io/v1/InferencePool",
                    "--set", "router.inferencePool.pools[0].endpointPicker.name=chat-epp")
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    role = by[("ClusterRole", "rel-router")]
    assert {v for r in role["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    assert sorted(x for r in role["rules"] for x in r["resources"]) == ["modelservices", "pods"]
    dep = by[("Deployment", "rel-router")]
    assert dep["spec"]["replicas"] == 3 and dep["spec"]["template"]["spec"]["serviceAccountName"] == "rel-router"
    svc = by[("Service", "rel-router")]
    assert svc["spec"]["ports"][0]["port"] == 8080
    # the routing rule: ttft unless the values say share
    assert "--route=ttft" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    share = rendered(helm, "--set", "router.route=share")
    assert (
        "--route=share"
        in next(d for d in share if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-router")["spec"][
            "template"
        ]["spec"]["containers"][0]["args"]
    )
    env = {e["name"]: e.get("value") for e in
           by[("Deployment", "rel-operator")]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KASCADE_OPERATOR_ROUTER_URL"] == "http://rel-router.ns.svc:8080"  # -> ModelService status.url
    # demand is read from every router pod: a headless Service selecting exactly the router pods
    assert env["KASCADE_OPERATOR_ROUTER_DEMAND_URL"] == "http://rel-router-pods.ns.svc:9090"  # the admin port
    pods_svc = by[("Service", "rel-router-pods")]
    # the admin routes (engine addresses, demand, /metrics) only on the headless Service, not the client one
    assert "--admin-port=9090" in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
    assert {"name": "admin", "port": 9090, "targetPort": "admin"} in pods_svc["spec"]["ports"]
    assert pods_svc["spec"]["clusterIP"] == "None" and pods_svc["spec"]["selector"] == svc["spec"]["selector"]
    assert pods_svc["metadata"]["labels"]["app.kubernetes.io/component"] != "router"  # not scraped twice
    pool = by[("InferencePool", "chat")]
    assert pool["spec"]["selector"] == {
        "matchLabels": {"kascade.io/model-service": "chat", "kascade.io/serving": "true"}
    }
    assert pool["spec"]["endpointPickerRef"]["name"] == "chat-epp"
    pool_spec = by[("Deployment", "rel-pool")]["spec"]["template"]["spec"]
    pod = pool_spec["containers"][0]
    # Ready while healthy, idle too (the Deployment is available); serving is the operator's label, which the
    # InferencePool above selects (bound and loaded or live, not draining)
    assert pod["readinessProbe"]["httpGet"]["path"] == "/healthz" and "readinessGates" not in pool_spec
    op_rules = by[("ClusterRole", "rel-operator")]["rules"]
    assert {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]} in op_rules
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "PodDisruptionBudget"} == {
        k for k, n in by if n == "rel-router"}
    pdb = by[("PodDisruptionBudget", "rel-router")]
    assert pdb["spec"] == {"minAvailable": 1, "selector": dep["spec"]["selector"]}
    one = rendered(helm, "--set", "router.replicas=1", "--set", "router.priorityClassName=hi",
                   "--set", "router.affinity.nodeAffinity.x=1")
    assert not [d for d in one if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == "rel-router"]
    spec1 = next(d for d in one if d["metadata"]["name"] == "rel-router" and d["kind"] == "Deployment")["spec"][
        "template"
    ]["spec"]
    assert spec1["priorityClassName"] == "hi" and spec1["affinity"] == {"nodeAffinity": {"x": 1}}
    assert {k for k, n in by if n == "rel-router-pods"} == {"Service"}
    off = rendered(helm, "-n", "ns", "--set", "router.enabled=false")
    assert not [d for d in off if d["metadata"]["name"].endswith("-router")]
    # without the router, helm test's front door is the engines Service and the operator has no router URL
    test_args = next(d for d in off if d["kind"] == "Pod")["spec"]["containers"][0]["args"]
    assert "http://rel-engines.ns.svc:8000" in test_args
    op_env = {
        e["name"]
        for e in next(d for d in off if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-operator")["spec"][
            "template"
        ]["spec"]["containers"][0]["env"]
    }
    assert "KASCADE_OPERATOR_ROUTER_URL" not in op_env and "KASCADE_OPERATOR_ROUTER_DEMAND_URL" not in op_env


def test_router_api_keys_come_from_a_secret(helm: Helm) -> None:
    """router.auth.existingSecret mounts the Secret and points --api-keys-file at its key; unset: no auth."""

    def router_pod(*sets: str) -> dict:
        docs = rendered(helm, *(a for s in sets for a in ("--set", s)))
        return next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "rel-router")["spec"][
            "template"
        ]["spec"]

    plain = router_pod()
    assert not any(a.startswith("--api-keys-file") for a in plain["containers"][0]["args"])
    spec = router_pod("router.auth.existingSecret=keys", "router.auth.secretKey=k.txt", "dataPlaneTls.secretName=tls")
    assert "--api-keys-file=/etc/kascade/router-auth/k.txt" in spec["containers"][0]["args"]
    mounts = {m["name"]: m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["router-auth"] == "/etc/kascade/router-auth" and len(mounts) == 2  # beside the engine CA
    vols = {v["name"]: v for v in spec["volumes"]}
    assert vols["router-auth"]["secret"]["secretName"] == "keys"
