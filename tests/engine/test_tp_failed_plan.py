"""A tensor-parallel load plan that fails fails the *load*, not the instance, and the next plan loads it (the e2e
test_tp2_target_rank_killed_mid_transfer_is_replaced failed in CI this way; issue 40).

The race, reproduced here without a cluster: a TP-2 source's rank 0 finished its share of a plan (its target's
rank 0 went away at once) while its rank 1 still retried the target's rank 1, which died before it listened, for
the plan's timeout. The operator's next plan reached the source (rank 0 idle, so accepted) and its rank 1's serve
failed on its own data port, still held by the first serve. The new target's plane 1 failed, every rank agreed
it failed, and the target exited 3, though nothing was wrong with it: with no spare pool pod left the service
never reached two replicas. Now a rank's serves take turns on its port, and a plan that every rank agrees failed
leaves the instance up, empty, naming the error, so the operator releases it and plans again.

Real engine processes (`kascade engine serve --tp 2`), real TCP data plane, the tiny Llama.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kascade_devcluster.ports import free_port_runs
from kascade_engine.weights.blocks import BlockSet

from .conftest import start_engine
from .test_tp_matched import H, _plan, _text, _wait_ready


def _hang_up_on_everyone(port: int) -> socket.socket:
    """A listener that accepts every connection and closes it at once (a target rank that died as it answered)."""
    srv = socket.create_server(("127.0.0.1", port))

    def loop() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return srv


def _followers(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _post_plan(url: str, doc: dict[str, Any], me: str, deadline_s: float = 0.0) -> httpx.Response:
    """POST a load plan; with `deadline_s`, retry a 409 (a load still running there) until then."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.post(url + "/kascade/v1/load-plan", json={**doc, "self": me}, headers=H, timeout=60)
        if r.status_code != 409 or time.monotonic() >= end:
            return r
        time.sleep(0.1)


def test_a_failed_plane_fails_the_load_not_the_instance_and_the_next_plan_loads(tiny_ckpt: Path,
                                                                                 tiny_blocks: BlockSet) -> None:
    common = ["--checkpoint", str(tiny_ckpt), "--model-name", "tiny-llama", "--max-prompt-tokens", "64",
              "--kv-tokens", "4096"]
    src = start_engine([*common, "--tp", "2"])
    dst = start_engine([*common, "--tp", "2", "--empty"])
    srv: socket.socket | None = None
    try:
        want = _text(src.url)
        manifest = httpx.get(src.url + "/kascade/v1/manifest?parts=2", headers=H).json()
        sp, tgt, ghost = free_port_runs(3, 2)  # each instance's rank r on port + r, as the pods' data ports
        plan = _plan(tiny_blocks, "s0", "t0")
        # 1. a plan whose source is never told: both of the target's planes fail, every rank agrees, nothing kept
        doc = {"plan": plan, "peers": {"s0": f"127.0.0.1:{sp}", "t0": f"127.0.0.1:{tgt}"}, "planToken": "p1",
               "timeoutSeconds": 2, "manifest": manifest}
        assert _post_plan(dst.url, doc, "t0").status_code == 200
        st = _wait_ready(dst.url, 120)
        assert st["loadError"] and not st["ready"], st
        assert dst.proc.poll() is None, "the target exited on a failed load plan"
        assert len(_followers(dst.proc.pid)) == 1  # its follower rank too is still there
        assert httpx.post(dst.url + "/kascade/v1/release", headers=H, json={}).status_code == 200
        # 2. the source's rank 0 finishes its share of a plan at once (its target's rank 0 hangs up) while its
        # rank 1 retries the target's rank 1, which never listens, for the plan's timeout...
        srv = _hang_up_on_everyone(ghost)
        doc = {"plan": _plan(tiny_blocks, "s0", "g0"), "peers": {"s0": f"127.0.0.1:{sp}", "g0": f"127.0.0.1:{ghost}"},
               "planToken": "p2", "timeoutSeconds": 4}
        assert _post_plan(src.url, doc, "s0").status_code == 200
        # 3. ...and the next plan comes at once: the target loads, every rank's slices from the same source rank
        # over the same ports (rank 1's serve waits for the first to leave its port)
        doc = {"plan": plan, "peers": {"s0": f"127.0.0.1:{sp}", "t0": f"127.0.0.1:{tgt}"}, "planToken": "p3",
               "manifest": manifest}
        assert _post_plan(dst.url, doc, "t0").status_code == 200
        r = _post_plan(src.url, {k: v for k, v in doc.items() if k != "manifest"}, "s0", deadline_s=15)
        assert r.status_code == 200, r.text
        st = _wait_ready(dst.url, 120)
        assert st["ready"] and st["loadError"] is None, st
        assert sorted(int(s["rank"]) for s in st["tpLoad"]) == [0, 1]
        assert _text(dst.url) == want
    finally:
        if srv is not None:
            srv.close()
        for e in (src, dst):
            e.stop()
