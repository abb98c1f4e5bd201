"""A ModelService's kopf resume (the operator starting) is queued for the bounded workers, not run inline: at 1,000
services the resumes were 1,000 concurrent rounds (issue 33). A create or update still runs its round at once.

The in-memory kube layer (fakekube.py) and real-HTTP engine stand-ins (enginestub.py); a WorkQueue whose round is
recorded, not run."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from enginestub import EngineStub
from fakekube import FakeKube
from stubruntime import stub_runtime

from kascade_operator.handlers import service_changed
from kascade_operator.workqueue import WorkQueue

NS, TOKEN = "ns", "resume-token"


def service() -> dict[str, Any]:
    return {"metadata": {"name": "svc", "namespace": NS, "uid": "uid-svc", "generation": 1},
            "spec": {"model": {"name": "tiny", "source": {"path": "/models/tiny"}, "layers": 2},
                     "engine": {"image": "kascade:dev"}, "replicas": {"colocated": {"min": 1, "max": 2}}}}


async def test_a_resume_is_queued_and_a_create_runs_its_round_at_once() -> None:
    kube = FakeKube()
    kube.nodes = [{"metadata": {"name": "n0", "labels": {"kascade.io/leaf": "l0", "kascade.io/nic-gbps": "100",
                                                        "kascade.io/scaleup-domain": "d0"}},
                   "status": {"allocatable": {"nvidia.com/gpu": "8"}, "capacity": {"nvidia.com/gpu": "8"}}}]
    stub = EngineStub("e0", "tiny", TOKEN, auto_ready=True)
    kube.add_pool_pod(NS, stub.instance, "n0", stub.endpoint, model="tiny")
    taken: list[Hashable] = []

    async def record(key: Hashable) -> None:
        taken.append(key)

    async with stub_runtime(kube, [stub], TOKEN) as rt:
        rt.queue = WorkQueue(record, workers=1)  # not started: what is queued stays visible
        await service_changed(rt, service(), "resume")
        due = rt.queue.due_in((NS, "svc"))
        # queued for a worker (urgent, due now); no round ran
        assert kube.plans == {} and due is not None and due <= 0.0 and rt.queue.urgent((NS, "svc"))
        await service_changed(rt, service(), "create")
        assert len(kube.plans) == 1  # the create's round ran inline: its first copy's ScalePlan
        assert taken == []
