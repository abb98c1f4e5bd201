"""The engine token Secret the operator creates or adopts (issue 32: a token generated at `helm template`
changed at every GitOps render). On the real API server: the first start creates it, every later start
and every other replica reads the same token, a start racing another ends with one token, and without
permission to create (existingSecret) the operator waits, then fails with a message naming the Secret."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_operator import enginetoken
from kascade_operator.kube import Kube

pytestmark = pytest.mark.cluster


def secret_token(cp: ControlPlane, ns: str, name: str) -> str:
    doc = json.loads(cp.kubectl("-n", ns, "get", "secret", name, "-o", "json").stdout)
    return base64.b64decode(doc["data"]["token"]).decode()


async def test_created_once_then_adopted_by_every_start(control_plane: ControlPlane, namespace: str) -> None:
    kube = await Kube.connect(str(control_plane.kubeconfig))
    try:
        first = await enginetoken.ensure(kube, namespace, "rel-engine-token", create=True)
        assert len(first) >= 32 and secret_token(control_plane, namespace, "rel-engine-token") == first
        # a restart, a standby, an upgrade's new pod: all adopt it
        again = await asyncio.gather(*(enginetoken.ensure(kube, namespace, "rel-engine-token", create=True)
                                       for _ in range(3)))
        assert again == [first] * 3
        # two replicas racing on an absent Secret end with one token between them
        raced = await asyncio.gather(*(enginetoken.ensure(kube, namespace, "race-token", create=True)
                                       for _ in range(4)))
        assert len(set(raced)) == 1 and secret_token(control_plane, namespace, "race-token") == raced[0]
        labels = json.loads(control_plane.kubectl("-n", namespace, "get", "secret", "race-token", "-o",
                                                  "json").stdout)["metadata"]["labels"]
        assert labels == {enginetoken.CREATED_BY: "kascade-operator"}
    finally:
        await kube.close()


async def test_existing_secret_is_waited_for_then_named(control_plane: ControlPlane, namespace: str) -> None:
    kube = await Kube.connect(str(control_plane.kubeconfig))
    try:
        with pytest.raises(enginetoken.TokenUnavailable, match=f"{namespace}/mine"):
            await enginetoken.ensure(kube, namespace, "mine", create=False, wait_s=0.5, poll_s=0.1)
        waiter = asyncio.create_task(enginetoken.ensure(kube, namespace, "mine", create=False, wait_s=30, poll_s=0.1))
        await asyncio.sleep(0.3)
        control_plane.kubectl("-n", namespace, "create", "secret", "generic", "mine", "--from-literal=token=s3cret")
        assert await waiter == "s3cret"  # created by the user meanwhile: read, never replaced
    finally:
        await kube.close()
