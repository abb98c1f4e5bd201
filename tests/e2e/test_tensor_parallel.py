"""A `tp: 2` ModelService end to end on the real control plane with REAL engines (issue 34): KWOK nodes, pool
pods backed by `kascade engine serve --empty --tp 2` processes (two ranks each, rank r on data port + r), the
operator as a real process.

Shown here: the first copy loads from the source path into both ranks; raising the minimum makes a chain
ScalePlan whose plan is the unsharded instance plan from a 2-GPU source into 2-GPU targets; the engines run it as
two rank planes of slices (matched TP), each rank receiving exactly its slices from the source's same rank over its
own port, and the new replica answers exactly like the first.
And the fault: a target's follower rank SIGKILLed mid-transfer takes its engine down (exit 3) and the service
still reaches two replicas on another pod, every one answering like the first.
Live scaling (`spec.scaling.live`, on by default): the ScalePlan pairs the loading TP-2 target with its TP-2 source,
and the target, installing layer by layer on both ranks (engine tp/progressive.py), serves requests split with the
source before its load completes, with no failed request anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kascade_devcluster.controlplane import ControlPlane
from kascade_devcluster.enginepool import EnginePool
from kascade_devcluster.operatorproc import OperatorProcess
from kascade_devcluster.waiting import wait_for

from .test_real_engines import (
    MODEL,
    TOKEN,
    complete,
    engine_status,
    get,
    live_split,
    loaded,
    msvc,
    serve_first_copy,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kascade_engine.weights.checkpoint import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("ckpt") / MODEL, layers=8, hidden=256, vocab=2048)


@pytest.fixture
def world(control_plane: ControlPlane, crds: list[str], namespace: str, kwok_nodes: Callable[..., list[str]],
          ckpt: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[EnginePool, OperatorProcess]]:
    nodes = kwok_nodes(3, leaves=1)
    mbps = str(getattr(request, "param", 40))  # the sources' egress cap (rank 0's plane; its first MiB a burst)
    pool = EnginePool(control_plane, namespace, ckpt, MODEL, TOKEN, tmp_path / "engines", tp=2,
                      extra_args=("--transfer-max-mbps", mbps, "--kv-tokens", "8192"))
    op = OperatorProcess(control_plane, namespace, TOKEN, tmp_path / "operator.log")
    try:
        pool.start(nodes)
        op.start()
        yield pool, op
    finally:
        op.stop()
        print(op.tail())
        pool.stop()


def tp_msvc(ckpt: Path, lo: int) -> dict[str, Any]:
    doc = msvc(ckpt, lo, 3, upper=1e9, lower=0)
    doc["spec"]["engine"]["tp"] = 2
    return doc


def scale_to_two(cp: ControlPlane, ns: str, pool: EnginePool, ckpt: Path) -> tuple[str, str, dict[str, Any]]:
    src = serve_first_copy(cp, ns, tp_msvc(ckpt, 1))
    assert engine_status(pool, src)["ready"]
    want = complete(pool.engines[src].url)
    cp.kubectl("-n", ns, "patch", "msvc", "svc", "--type=merge", "-p",
               json.dumps({"spec": {"replicas": {"colocated": {"min": 2}}}}))
    plan = wait_for(lambda: [p for p in get(cp, ns, "splan")["items"] if p["spec"]["algorithm"] == "chain"],
                    60, "a chain ScalePlan")[0]
    return src, want, plan


def test_tp2_service_scales_by_rank_planes_and_serves_the_same_text(
        control_plane: ControlPlane, namespace: str, world: tuple[EnginePool, OperatorProcess], ckpt: Path) -> None:
    cp, ns = control_plane, namespace
    pool, _ = world
    _, want, plan = scale_to_two(cp, ns, pool, ckpt)
    spec = plan["spec"]
    assert [t["gpus"] for t in spec["plan"]["targets"]] == [2] and "shards" not in spec  # the engines shard it
    wait_for(lambda: len(loaded(cp, ns)) == 2, 120, "2 ready replicas")
    target = spec["targets"][0]["instance"]
    st = engine_status(pool, target)
    per_rank = sorted(st["tpLoad"], key=lambda s: s["rank"])
    # matched TP (a TP-2 source): each rank received exactly its slices from the source's same rank, no gather
    source = pool.engines[spec["sources"][0]["instance"]]
    manifest = httpx.get(source.url + "/kascade/v1/manifest?parts=2", headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=60).json()
    assert len(per_rank) == 2, per_rank
    for r, s in enumerate(per_rank):
        assert s["bytes"] == sum(e["bytes"] for k, e in manifest.items() if k.endswith(f"@{r}/2")), per_rank
        assert s["gatherSeconds"] == 0
    total = sum(s["bytes"] for s in per_rank)
    assert total > 20_000_000  # the whole model crossed, each rank's slices over its own port
    for p in loaded(cp, ns):
        assert complete(pool.engines[p["metadata"]["name"]].url) == want


def test_tp2_target_rank_killed_mid_transfer_is_replaced(
        control_plane: ControlPlane, namespace: str, world: tuple[EnginePool, OperatorProcess], ckpt: Path) -> None:
    cp, ns = control_plane, namespace
    pool, _ = world
    src, want, plan = scale_to_two(cp, ns, pool, ckpt)
    target = plan["spec"]["targets"][0]["instance"]
    e = pool.engines[target]
    # loading, or live (paired with the source, serving its installed layers: the plan is live by default)
    wait_for(lambda: engine_status(pool, target)["phase"] in ("loading", "live"), 30, "the target loading")
    kids = Path(f"/proc/{e.proc.pid}/task/{e.proc.pid}/children").read_text().split()
    assert len(kids) == 1, kids  # its follower rank
    os.kill(int(kids[0]), signal.SIGKILL)
    wait_for(lambda: len(loaded(cp, ns)) == 2, 180, "2 ready replicas again")
    names = {p["metadata"]["name"] for p in loaded(cp, ns)}
    assert target not in names and src in names
    for n in names:  # never the dead instance's weights: every replica answers like the first copy
        assert complete(pool.engines[n].url) == want


@pytest.mark.parametrize("world", [5], indirect=True)  # 5 Mbit/s: rank 0's 13.6 MB of slices take ~20 s
def test_tp2_live_service_scales_and_the_new_replica_serves_split_while_it_loads(
        control_plane: ControlPlane, namespace: str, world: tuple[EnginePool, OperatorProcess], ckpt: Path) -> None:
    cp, ns = control_plane, namespace
    pool, _ = world
    src, want, plan = scale_to_two(cp, ns, pool, ckpt)
    spec = plan["spec"]
    target = spec["targets"][0]["instance"]
    assert [(lp["overloaded"], lp["loading"]) for lp in spec["livePairs"]] == [(src, target)]
    failed: list[str] = []
    stop = threading.Event()

    def source_load() -> None:  # the source serves on throughout (its pair hosts the target's rows)
        while not stop.is_set():
            try:
                if complete(pool.engines[src].url) != want:
                    failed.append("the source answered other text")
            except (AssertionError, httpx.HTTPError) as e:
                failed.append(f"source: {e}")

    bg = threading.Thread(target=source_load, daemon=True)
    bg.start()
    try:
        st = wait_for(lambda: (s := engine_status(pool, target))["phase"] == "live" and s, 120,
                      "the target live (its first layers installed on both ranks, paired)")
        assert not st["ready"]
        url = pool.engines[target].url
        while_loading = 0
        while not engine_status(pool, target)["ready"]:
            assert complete(url) == want  # layers it holds on its two ranks, the rest on the source
            while_loading += 0 if engine_status(pool, target)["ready"] else 1
        assert while_loading > 0, "the target completed before it answered a request while loading"
        print(f"{while_loading} requests answered split by the TP-2 target while it loaded")
        assert live_split(pool, target) >= while_loading
        wait_for(lambda: len(loaded(cp, ns)) == 2, 180, "2 ready replicas")
        for p in loaded(cp, ns):
            assert complete(pool.engines[p["metadata"]["name"]].url) == want
        time.sleep(0.5)
    finally:
        stop.set()
        bg.join(60)
    assert failed == []
