"""The Kascade story in pods on kind: the chart's own Deployments, real kubelets, a real pod network.

The tests run in file order on one release (module fixture `release`): the first copy loads from the
model volume, a burst goes through the router's Service, a chain ScalePlan copies between engine pods
over pod IPs, scale down, scale to zero and back; `helm upgrade` with unchanged values and `helm rollback`;
then the faults (an engine pod killed mid-transfer, the operator's leader killed mid-plan, a drained worker)
and `helm uninstall`. Every request sent is counted as answered or failed.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kascade_devcluster.loadgen import LoadGen
from kascade_devcluster.requirement import unavailable

from .conftest import ENGINE_NODE, NS, OPERATOR_IMAGE, REPO, Kind

pytestmark = [pytest.mark.kind, pytest.mark.slow, pytest.mark.timeout(1800)]
MSVC, MODEL = "tiny", "tiny-kind"
# every request the story sends, per test: answered, or failed (with its error); printed at the end
TALLY: dict[str, dict[str, Any]] = {}


def tally(test: str, gen: LoadGen) -> dict[str, float]:
    TALLY[test] = {**gen.summary(), "errors": gen.failures()[:3]}
    return gen.summary()


def wait(pred: Callable[[], Any], what: str, timeout: float = 240, k: Kind | None = None) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(1)
    diag = ""
    if k is not None:
        diag = k.kubectl("-n", NS, "get", "msvc,splan,pods", "-o", "wide", check=False)
        diag += k.kubectl("-n", NS, "logs", "-l", "app.kubernetes.io/component=operator", "--tail=60",
                          "--prefix", check=False)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{diag}")


def _repo_tag(image: str) -> tuple[str, str]:
    repo, _, tag = image.rpartition(":")
    return repo, tag


def need_engine(k: Kind) -> None:
    if k.no_engine:
        unavailable(k.no_engine)


def helm_args(k: Kind) -> list[str]:
    """e2e/kind/values.yaml (the pool from kascade:e2e, the engine image), the operator image for the
    operator and router."""
    orepo, otag = _repo_tag(OPERATOR_IMAGE)
    return [str(REPO / "charts" / "kascade"), "-n", NS, "-f", str(REPO / "e2e" / "kind" / "values.yaml"),
            "--set", f"image.repository={orepo},image.tag={otag}",
            "--set", f"pool.nodeSelector.kubernetes\\.io/hostname={ENGINE_NODE}",
            *(["--set", "pool.replicas=0"] if k.no_engine else [])]


def msvc(k: Kind) -> dict:
    return k.get("-n", NS, "msvc", MSVC)


def ready(k: Kind) -> int:
    return int(msvc(k).get("status", {}).get("readyReplicas") or 0)


def plans(k: Kind) -> list[dict]:
    return k.get("-n", NS, "splan")["items"]


def pods(k: Kind, selector: str) -> list[dict]:
    return k.get("-n", NS, "pods", "-l", selector)["items"]


def router_url(k: Kind) -> str:
    ip = k.get("-n", NS, "svc", "kascade-router")["spec"]["clusterIP"]
    return f"http://{ip}:8080"


@pytest.fixture(scope="module")
def release(kind_cluster: Kind) -> Iterator[Kind]:
    k = kind_cluster
    k.kubectl("create", "namespace", NS, check=False)
    k.kubectl("label", "namespace", NS, "pod-security.kubernetes.io/enforce=restricted",
              "pod-security.kubernetes.io/enforce-version=latest", "--overwrite")
    k.kubectl("apply", "-f", str(REPO / "e2e" / "kind" / "models-pv.yaml"))
    t0 = time.monotonic()
    k.helm("upgrade", "--install", "kascade", *helm_args(k))
    wait(lambda: all(len([p for p in pods(k, f"app.kubernetes.io/component={c}")
                          if _ready(p)]) >= 2 for c in ("operator", "router")),
         "2 operator and 2 router pods Ready", 300, k)
    print(f"kind: chart installed, operator and router Ready in {time.monotonic() - t0:.0f} s")
    if not k.no_engine:
        k.kubectl("-n", NS, "apply", "-f", str(REPO / "e2e" / "kind" / "modelservice.yaml"))
    yield k


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod.get("status", {}).get("conditions", []))


def test_first_copy_loads_from_the_model_volume(release: Kind) -> None:
    k = release
    need_engine(k)
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=1")  # min is 0 (scale to zero below)
    wait(lambda: ready(k) >= 1, "the first copy to load", 300, k)
    bound = [p for p in pods(k, "kascade.io/pool=bound") if _ready(p)]
    assert len(bound) == 1, [p["metadata"]["name"] for p in bound]
    assert bound[0]["spec"]["nodeName"] in k.nodes()


def test_burst_through_the_router_service(release: Kind) -> None:
    k = release
    need_engine(k)
    gen = LoadGen(router_url(k), MODEL, prompt=list(range(1, 17)), max_tokens=8, timeout_s=60).start(8)
    try:
        gen.set_load(8)
        time.sleep(20)
        gen.set_load(0)
    finally:
        gen.stop()
    s = tally("burst_through_the_router_service", gen)
    print(f"kind: burst {s}")
    assert s["requests"] >= 20, s
    assert s["failed"] == 0, gen.failures()[:5]


def test_chain_scale_plan_between_engine_pods(release: Kind) -> None:
    k = release
    need_engine(k)
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=3")
    done = wait(lambda: [p for p in plans(k) if p.get("status", {}).get("phase") == "Succeeded"
                         and p["spec"].get("algorithm") == "chain"], "a chain ScalePlan to succeed", 300, k)
    plan = done[0]
    ips = {p.get("status", {}).get("podIP") for p in pods(k, "app.kubernetes.io/component=engine")}
    print("kind: chain plan", json.dumps({"spec": {x: plan["spec"].get(x) for x in ("sources", "targets", "chains")},
                                          "status": plan["status"]})[:1500])
    wait(lambda: ready(k) == 3, "3 ready replicas", 240, k)
    assert all(p.get("status", {}).get("phase") != "Failed" for p in plans(k)), [p["status"] for p in plans(k)]
    assert len(ips) >= 3


def test_scale_down_to_zero_and_back(release: Kind) -> None:
    """Down to one with the scale subresource; to zero the way min 0 allows (idleReleaseSeconds without
    a request, the policy in charge: `kubectl scale --replicas=0` keeps the last copy); back from zero
    on a request the router holds meanwhile."""
    k = release
    need_engine(k)
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=1")
    wait(lambda: ready(k) == 1, "scale down to 1", 240, k)
    k.kubectl("-n", NS, "patch", "msvc", MSVC, "--type=json", "-p", '[{"op":"remove","path":"/spec/replicas/desired"}]')
    wait(lambda: ready(k) == 0 and not pods(k, "kascade.io/pool=bound"), "scale to zero after idleReleaseSeconds",
         240, k)
    gen = LoadGen(router_url(k), MODEL, prompt=list(range(1, 9)), max_tokens=4, timeout_s=180).start(1)
    t0 = time.monotonic()
    try:
        gen.set_load(1, think_s=1.0)
        wait(lambda: ready(k) == 1, "back from zero on a held request", 300, k)
        wait(lambda: gen.summary()["ok"] >= 1, "the held request answered", 180, k)
    finally:
        gen.set_load(0)
        gen.stop()
    s = tally("scale_down_to_zero_and_back", gen)
    print(f"kind: back from zero in {time.monotonic() - t0:.1f} s; requests {s}")
    assert s["ok"] >= 1 and s["failed"] == 0, gen.failures()[:5]


def test_helm_upgrade_with_unchanged_values_restarts_nothing(release: Kind) -> None:
    """Same values: no Deployment gets a new template (generation), no container restarts, the engine
    token Secret keeps its value (pool pods come and go on their own as the operator binds them)."""
    k = release
    gens, restarts, token = _snapshot(k)
    k.helm("upgrade", "kascade", *helm_args(k))
    time.sleep(15)
    gens2, restarts2, token2 = _snapshot(k)
    assert gens2 == gens, (gens, gens2)
    assert {n: r for n, r in restarts2.items() if n in restarts} == {
        n: r for n, r in restarts.items() if n in restarts2
    }
    assert token2 == token


def _snapshot(k: Kind) -> tuple[dict[str, int], dict[str, int], dict[str, str]]:
    """Deployment generations, container restarts per pod, the engine token Secret's data (the operator
    creates that Secret once; the chart does not render it)."""
    gens = {d["metadata"]["name"]: d["metadata"]["generation"] for d in k.get("-n", NS, "deploy")["items"]}
    restarts = {p["metadata"]["name"]: sum(c.get("restartCount", 0)
                                           for c in p.get("status", {}).get("containerStatuses", []))
                for p in k.get("-n", NS, "pods")["items"]}
    token = k.get("-n", NS, "secret", "kascade-engine-token")["data"]  # created once by the operator
    return gens, restarts, token


def test_helm_rollback_restarts_nothing(release: Kind) -> None:
    """`helm rollback` to the first revision (same chart, same values): a new revision, Deployed, and no
    Deployment template, container or engine token changes."""
    k = release
    gens, restarts, token = _snapshot(k)
    k.helm("rollback", "kascade", "1", "-n", NS, "--wait", "--timeout", "300s")
    history = json.loads(k.helm("history", "kascade", "-n", NS, "-o", "json"))
    print("kind: helm history", [(h["revision"], h["status"], h.get("description")) for h in history])
    assert history[-1]["status"] == "deployed" and "Rollback to 1" in history[-1]["description"], history[-1]
    time.sleep(15)
    gens2, restarts2, token2 = _snapshot(k)
    assert gens2 == gens, (gens, gens2)
    assert {n: r for n, r in restarts2.items() if n in restarts} == {n: r for n, r in restarts.items()
                                                                      if n in restarts2}
    assert token2 == token


def test_engine_pod_killed_mid_transfer(release: Kind) -> None:
    """A target engine pod is force-deleted while its weights are arriving, with requests flowing. The pool's
    engines send at most 10 Mbit/s (pool.extraArgs --transfer-max-mbps in e2e/kind/values.yaml), so the
    tiny model's copy takes seconds: the kill waits until the plan's status shows the target has received
    some blocks but not all. Then: the plan ends once (Failed, its only target dropped with a message:
    proof the kill landed before the copy completed), the pool's Deployment replaces the pod, a new plan
    brings the service to the replicas asked for, and every request is answered."""
    k = release
    need_engine(k)
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=1")
    wait(lambda: ready(k) == 1, "1 ready replica", 300, k)
    before = {p["metadata"]["name"] for p in plans(k)}
    gen = LoadGen(router_url(k), MODEL, prompt=list(range(1, 9)), max_tokens=4, timeout_s=180).start(2)
    name, target, t_transfer = "", "", 0.0
    at_kill: dict = {}
    final: dict = {}
    phases: list[str] = []
    try:
        gen.set_load(2, think_s=0.2)
        k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=2")
        end = time.monotonic() + 180
        while not at_kill and time.monotonic() < end:  # the first status showing part of the copy arrived
            plan = next((p for p in plans(k) if p["metadata"]["name"] not in before and p["spec"].get("targets")), {})
            if plan:
                name = plan["metadata"]["name"]
                target = plan["spec"]["targets"][0].get("pod") or plan["spec"]["targets"][0]["instance"]
                row = _target_row(plan, plan["spec"]["targets"][0]["instance"])
                t_transfer = t_transfer or (time.monotonic() if row.get("instructed") else 0.0)
                if 0 < row.get("blocksReceived", 0) < row.get("blocksTotal", 0):
                    at_kill = row
                    break
                assert plan.get("status", {}).get("phase") not in ("Succeeded", "Failed"), (
                    f"plan {name} ended before its status showed a partial copy (a copy faster than the "
                    f"status writes, or no copy over the data plane): {plan.get('status')}")
            time.sleep(0.2)
        assert at_kill, f"no partial copy seen in 180 s (plan {name or 'none'})"
        k.kubectl("-n", NS, "delete", "pod", target, "--grace-period=0", "--force", "--wait=false")
        print(f"kind: killed {target} {time.monotonic() - t_transfer:.1f} s into its transfer, at {at_kill}")

        def terminal() -> bool:
            ph = k.get("-n", NS, "splan", name).get("status", {}).get("phase")
            if ph and (not phases or phases[-1] != ph):
                phases.append(ph)
            return ph in ("Succeeded", "Failed")

        wait(terminal, f"ScalePlan {name} to end", 240, k)
        wait(lambda: ready(k) == 2, "2 ready replicas after the target pod was killed", 300, k)
        time.sleep(3)
        final = k.get("-n", NS, "splan", name)["status"]
        time.sleep(5)
        assert k.get("-n", NS, "splan", name)["status"]["phase"] == final["phase"], "the plan ended twice"
    finally:
        gen.set_load(0)
        gen.stop()
    s = tally("engine_pod_killed_mid_transfer", gen)
    print(f"kind: plan {name} phases seen {phases}; final {json.dumps(final)[:800]}; requests {s}")
    assert final["phase"] == "Failed" and final.get("message"), final  # the copy never completed
    assert _target_row({"status": final}, at_kill["instance"]).get("failed"), final
    assert phases.count("Failed") + phases.count("Succeeded") == 1, phases
    assert all(p.get("status", {}).get("phase") in ("Succeeded", "Failed") for p in plans(k)
               if p["metadata"]["name"] not in before), [p.get("status") for p in plans(k)]
    assert target not in [p["metadata"]["name"] for p in pods(k, "app.kubernetes.io/component=engine")]
    assert s["failed"] == 0, gen.failures()[:5]
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=1")  # what the next test scales up from
    wait(lambda: ready(k) == 1, "back to 1 ready replica", 240, k)


def _target_row(plan: dict, instance: str) -> dict:
    return next((r for r in plan.get("status", {}).get("targets") or [] if r.get("instance") == instance), {})


def test_operator_leader_killed_mid_plan(release: Kind) -> None:
    k = release
    need_engine(k)
    leader = _leader(k)
    before = {p["metadata"]["name"] for p in plans(k)}
    k.kubectl("-n", NS, "scale", "msvc", MSVC, "--replicas=2")
    wait(lambda: {p["metadata"]["name"] for p in plans(k)} - before, "a new ScalePlan", 120, k)
    k.kubectl("-n", NS, "delete", "pod", leader, "--grace-period=0", "--force", "--wait=false")
    wait(lambda: _leader(k) not in ("", leader), "a standby to take the Lease", 120, k)
    wait(lambda: ready(k) == 2, "2 ready replicas after the leader was killed", 300, k)
    # from zero (idleReleaseSeconds may have released it) 0 -> 2 is two plans: the first copy from disk,
    # then a copy from it; a duplicate would name one target pod twice
    new = [p for p in plans(k) if p["metadata"]["name"] not in before]
    targets = [t.get("pod") or t["instance"] for p in new for t in p["spec"].get("targets", [])]
    assert len(targets) == len(set(targets)) and len(targets) <= 2, [
        (p["metadata"]["name"], p["spec"].get("targets")) for p in new
    ]
    assert all(p.get("status", {}).get("phase") == "Succeeded" for p in new), [p.get("status") for p in new]


def test_standby_takes_the_lease_when_the_leader_is_killed(release: Kind) -> None:
    k = release
    leader = _leader(k)
    assert leader in [p["metadata"]["name"] for p in pods(k, "app.kubernetes.io/component=operator")]
    t0 = time.monotonic()
    k.kubectl("-n", NS, "delete", "pod", leader, "--grace-period=0", "--force", "--wait=false")
    new = wait(lambda: _leader(k) not in ("", leader) and _leader(k), "a standby to take the Lease", 120, k)
    print(f"kind: {new} leads {time.monotonic() - t0:.1f} s after {leader} was killed")
    wait(lambda: len([p for p in pods(k, "app.kubernetes.io/component=operator") if _ready(p)]) == 2,
         "2 operator pods Ready again", 240, k)


def _leader(k: Kind) -> str:
    """The operator pod holding the Lease (its identity is the pod name, or hostname-pid)."""
    holder = k.get("-n", NS, "lease", "kascade-operator")["spec"].get("holderIdentity") or ""
    names = {p["metadata"]["name"] for p in pods(k, "app.kubernetes.io/component=operator")}
    stripped = holder.rsplit("-", 1)[0]
    return stripped if holder not in names and stripped in names else holder


def test_drain_a_worker_loses_no_request(release: Kind) -> None:
    """The worker without the engines (the engine image is on one worker only, conftest.ENGINE_NODE):
    operator and router pods move under their PDBs (never fewer than one Ready) while requests flow."""
    k = release
    gen = LoadGen(router_url(k), MODEL, prompt=list(range(1, 9)), max_tokens=4, timeout_s=180).start(2)
    node = next(n for n in k.nodes() if n != ENGINE_NODE)
    low: dict[str, int] = {"operator": 2, "router": 2}
    try:
        if not k.no_engine:
            gen.set_load(2, think_s=0.2)
            time.sleep(3)
        drain = subprocess.Popen([str(k.bins / "kubectl"), f"--kubeconfig={k.kubeconfig}", "drain", node,
                                  "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=240s"],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        while drain.poll() is None:
            for c in low:
                low[c] = min(low[c], len([p for p in pods(k, f"app.kubernetes.io/component={c}") if _ready(p)]))
            time.sleep(0.5)
        out = drain.stdout.read() if drain.stdout else ""
        assert drain.returncode == 0, out
        for c in low:
            wait(lambda c=c: len([p for p in pods(k, f"app.kubernetes.io/component={c}") if _ready(p)]) == 2,
                 f"2 {c} pods Ready after the drain", 240, k)
        if not k.no_engine:
            time.sleep(5)
    finally:
        gen.set_load(0)
        gen.stop()
        k.kubectl("uncordon", node, check=False)
    s = tally("drain_a_worker_loses_no_request", gen)
    print(f"kind: drain of {node}: fewest Ready {low}; requests {s}")
    assert min(low.values()) >= 1, low
    assert s["failed"] == 0, gen.failures()[:5]


def test_helm_uninstall(release: Kind) -> None:
    """What remains after `helm uninstall`: no Deployment; the ModelService without the operator's finalizer
    (the chart's pre-delete hook, `kascade operator uninstall`, removed it), ScalePlans, the Lease and the
    CRDs (docs/upgrade.md). The namespace then deletes without help."""
    k = release
    k.helm("uninstall", "kascade", "-n", NS, "--wait", "--timeout", "300s")
    left = k.kubectl("-n", NS, "get", "deploy,pods,secret,lease,msvc,splan", "-o", "name", check=False)
    crds = k.kubectl("get", "crd", "-o", "name")
    fin = k.get("-n", NS, "msvc", MSVC)["metadata"].get("finalizers")
    print(f"kind: after uninstall, in {NS}:\n{left}\nCRDs:\n{crds}\nModelService finalizers: {fin}")
    total = {x: sum(int(t[x]) for t in TALLY.values()) for x in ("requests", "ok", "failed")}
    print(f"kind: requests over the story: {total}; per test: {json.dumps(TALLY)}")
    assert "deployment.apps/" not in left
    assert not fin, f"the pre-delete hook left the ModelService's finalizers: {fin}"
    k.kubectl("-n", NS, "delete", "msvc", "--all", "--timeout=60s")
    k.kubectl("delete", "namespace", NS, "--timeout=120s")
    k.kubectl("delete", "pv", "kascade-kind-models", "--wait=false", check=False)
