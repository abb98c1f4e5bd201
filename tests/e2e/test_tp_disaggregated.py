"""A disaggregated `tp: 2` ModelService end to end on the real control plane with REAL engines (issue 34): KWOK
nodes, pool pods backed by `kascade engine serve --empty --tp 2` processes (two ranks each), the operator and the
router as real processes.

Shown here: the operator accepts `tp: 2` with `mode: disaggregated`, loads a prefill and a decode instance (both
TP-2), and the router serves in PD mode: the decode instance answers, the prefill instance prefilled, the prompt's KV
moved between them gathered at the prefill instance's rank 0 and scattered from the decode instance's rank 0
(docs/tp.md), no local fallback, and the greedy text equals the decode instance's own prefill.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.routerproc import RouterProcess
from kascade_devcluster.waiting import wait_for

from .test_disaggregated import complete, pd_world, routed_pd, serving

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def world(control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]],
          tmp_path: Path) -> Iterator[tuple[EnginePool, RouterProcess]]:
    def tp2(doc: dict[str, Any]) -> None:
        doc["spec"]["engine"]["tp"] = 2
        doc["spec"]["replicas"] = {"prefill": {"min": 1, "max": 1}, "decode": {"min": 1, "max": 1}}

    with pd_world(control_plane, namespace, kwok_nodes(3, leaves=1), tmp_path, tp=2, edit=tp2) as w:
        yield w


def test_tp2_pd_service_prefills_on_one_tp_instance_and_decodes_on_another(
        control_plane: ControlPlane, namespace: str, world: tuple[EnginePool, RouterProcess]) -> None:
    cp, ns = control_plane, namespace
    pool, router = world
    (pre,) = wait_for(lambda: serving(cp, ns, "prefill"), 240, "the TP-2 prefill instance serving")
    (dec,) = wait_for(lambda: serving(cp, ns, "decode"), 240, "the TP-2 decode instance serving")
    msvc_doc = json.loads(cp.kubectl("-n", ns, "get", "msvc", "svc", "-o", "json").stdout)
    assert not [c for c in msvc_doc["status"].get("conditions", [])
                if c["type"] == "Degraded" and c["status"] == "True"], msvc_doc["status"]

    r = routed_pd(pool, router, pre, dec)
    for name in (pre, dec):  # both instances run two ranks
        assert len(Path(f"/proc/{pool.engines[name].proc.pid}/task/{pool.engines[name].proc.pid}/children")
                   .read_text().split()) == 1
    assert r.json()["choices"][0]["text"] == complete(pool.engines[dec].url).json()["choices"][0]["text"]
