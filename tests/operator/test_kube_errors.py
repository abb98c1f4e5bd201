"""`Kube` against the real API server: an HTTP error is an error on every call, raw bodies included.

kubernetes_asyncio raises on an error status only when it preloads the body; `Kube` reads pods raw (no
model objects). Before this was checked, a 409 on the resourceVersion-guarded bind patch read as
success: the pod was never labelled and the plan waited for it forever (the real-engine e2e stall).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_operator.kube import Conflict, Kube, NotFound

pytestmark = pytest.mark.cluster


def _pod(ns: str, name: str) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": name, "namespace": ns, "labels": {"kascade.io/pool": "warm"}},
                       "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "x"}]}})


def test_guarded_patch_conflict_missing_pod_and_timeout_are_errors(control_plane: ControlPlane,
                                                                   namespace: str) -> None:
    ns = namespace
    control_plane.kubectl("apply", "-f", "-", input=_pod(ns, "p0"))

    async def run() -> None:
        kube = await Kube.connect(str(control_plane.kubeconfig))
        try:
            pod = await kube.get_pod(ns, "p0")
            stale = pod["metadata"]["resourceVersion"]
            fresh = await kube.patch_pod(ns, "p0", {"metadata": {"resourceVersion": stale,
                                                                 "annotations": {"a": "1"}}})
            assert fresh["metadata"]["annotations"]["a"] == "1"
            # the same guard again: the pod changed since `stale`, so the label must not be written
            with pytest.raises(Conflict, match="p0"):
                await kube.patch_pod(ns, "p0", {"metadata": {"resourceVersion": stale,
                                                             "labels": {"kascade.io/pool": "bound"}}})
            assert (await kube.get_pod(ns, "p0"))["metadata"]["labels"]["kascade.io/pool"] == "warm"
            with pytest.raises(NotFound, match="nope"):
                await kube.get_pod(ns, "nope")
            with pytest.raises(NotFound, match="nope"):
                await kube.patch_pod(ns, "nope", {"metadata": {"annotations": {"a": "1"}}})
            with pytest.raises(NotFound, match="nope"):
                await kube.delete_pod(ns, "nope")
            await kube.delete_pod(ns, "p0")
        finally:
            await kube.close()
        # a client whose calls cannot finish in time raises instead of hanging the caller forever
        slow = await Kube.connect(str(control_plane.kubeconfig))
        slow.t = 1e-4
        try:
            with pytest.raises(TimeoutError):
                await slow.list_pods(ns)
        finally:
            await slow.close()

    asyncio.run(run())
