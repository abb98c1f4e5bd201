"""The fault matrix (`make chaos`): every fault at every position of a 1->3 chain, over both transports,
on real transfer processes (`kascade transfer run`), ends in bounded time with every surviving target
byte-identical and every failure named in the logs.

Faults: SIGKILL; SIGSTOP for 1.5 x timeoutSeconds then SIGCONT; a connection cut mid-stream; a stream
desync (a frame read short, so the next header starts inside a payload; at the source: a chunk sent to
the wrong offset); a throttle (a relay forwards at a tenth of the chain's rate, the last node reads at
that rate, the source sends at half its rate: slower, nothing to drop). Positions: source s0, first t0, middle t1, last t2 of s0 -> t0 -> t1 -> t2.
Bound: the run ends within 2 x timeoutSeconds (+ the pause itself for SIGSTOP) past a fault-free
baseline run measured first on the same transport. The source lingers (it is every target's fallback);
a SIGKILLed source leaves the targets nothing to recover from: they must fail, naming it, in bounded time.
The blocks are random bytes (64 MiB, more than socket buffers and relay queues hold, so a lagging node
really backs its upstream up); the source is throttled so each fault lands mid-transfer.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import signal
import subprocess
import time
from pathlib import Path
from types import ModuleType

import pytest

from kascade_engine.blocks import Block, BlockSet, digest_of
from kascade_engine.hostcache import open_cache
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import leaf_spine

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TIMEOUTS = {"tcp": 2.0, "ucx": 4.0}  # timeoutSeconds: UCX connection setup (peer-info exchange) alone
# took up to ~3 s on the loaded 2-core dev machines
CHUNK = {"tcp": 16 << 10, "ucx": 64 << 10}  # 16 KiB chunks over UCX crashed a sender (SIGSEGV in UCX) here
BASE_SECONDS = 1.5  # how long the throttled source takes to send everything, fault-free
POSITIONS = {"source": "s0", "first": "t0", "middle": "t1", "last": "t2"}
FAULTS = ["kill", "stop", "cut", "desync", "throttle"]
TARGETS = ("t0", "t1", "t2")
# What each fault must leave in the logs (its name, as the nodes saw it).
NAMED = {"kill": r"upstream \S+ failed|never connected|downstream \S+ dropped: lost|no fallback could provide",
         "stop": r"no data from|took nothing|lagging|never connected",
         "cut": r"fault injection: (inbound|outbound) connection cut",
         "desync": r"bad frame magic|malformed header|failed its digest|truncat|length mismatch|outside \[",
         "throttle": r"lagging|rateMBps"}


@pytest.fixture(scope="module")
def chaos_blocks() -> BlockSet:
    data = {b: memoryview(bytearray(secrets.token_bytes(8 << 20)))
            for b in ("embed", *(f"layer.{i}" for i in range(6)), "head")}
    return BlockSet("chaos", {}, (Block(b, v, (), digest_of(v)) for b, v in data.items()))


def _plan(blocks: BlockSet) -> Plan:
    topo = leaf_spine(1, 4, 8)
    nodes = [n.name for n in topo.nodes]
    model = ModelLayout("chaos", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", nodes[0])], [Instance(t, nodes[i + 1]) for i, t in enumerate(TARGETS)],
                     "chain")
    assert plan.chains == (("s0", *TARGETS),)
    return plan


def _faults(fault: str, victim: str, total: int) -> dict[str, dict[str, object]]:
    rate = total / BASE_SECONDS / 1e6
    f: dict[str, dict[str, object]] = {"s0": {"rateMBps": rate}}
    third = total // 3
    if victim == "s0":
        f["s0"].update({"cut": {"cutAfterBytes": third}, "desync": {"desyncAfterBytes": third},
                        "throttle": {"rateMBps": rate / 2}}.get(fault, {}))
    else:  # throttle: a relay forwards at a tenth of the chain's rate; the last node reads that slowly
        slow = {"recvRateMBps": rate / 10} if victim == TARGETS[-1] else {"rateMBps": rate / 10}
        f[victim] = {"cut": {"cutInboundAfterBytes": third}, "desync": {"desyncInboundAfterBytes": third},
                     "throttle": slow}.get(fault, {})
    return f


def _run(harness: ModuleType, workdir: Path, blocks: BlockSet, transport: str, fault: str | None,
         victim: str | None, summaries: dict[str, dict[str, object]]) -> tuple[float, dict[str, int | None], object]:
    """Run the chain with the fault; returns (seconds until the last process ended, exit codes, cluster)."""
    workdir.mkdir(parents=True, exist_ok=True)
    c = harness.make_cluster(workdir, blocks, _plan(blocks), transport=transport, chunk=CHUNK[transport],
                             faults=_faults(fault, victim, blocks.total_bytes) if fault and victim else
                             _faults("none", "s0", blocks.total_bytes), timeout_s=TIMEOUTS[transport])
    c.target_linger = 0.0
    t0 = time.monotonic()
    c.start_all()
    try:
        if fault in ("kill", "stop") and victim:
            watch = "t0" if victim == "s0" else victim  # mid-transfer: the watched node holds a first block
            harness.wait_for(lambda: f'"instance": "{watch}", "block"' in c.log(watch), timeout=30)
            if fault == "kill":
                c.kill(victim)
            else:
                c.signal(victim, signal.SIGSTOP)
                time.sleep(1.5 * TIMEOUTS[transport])
                c.signal(victim, signal.SIGCONT)
        codes: dict[str, int | None] = {}
        deadline = time.monotonic() + 60
        for t in TARGETS:
            p = c.procs[t]
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            codes[t] = p.poll()
        took = time.monotonic() - t0
        for t in TARGETS:
            if codes[t] == 0 and c.procs[t].stdout is not None:
                summaries[t] = json.loads(c.procs[t].stdout.read().strip().splitlines()[-1])
        return took, codes, c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def baselines() -> dict[str, float]:
    return {}


def _transport_ok(name: str) -> None:
    if name == "ucx":
        try:
            import ucxx  # noqa: F401
        except ImportError as e:
            from kascade_devcluster.requirement import unavailable

            unavailable(f"ucxx not importable: {e}")


def _identical(workdir: Path, target: str, blocks: BlockSet) -> bool:
    try:
        got = open_cache(workdir / f"{target}.kcache", verify=True)
    except (OSError, ValueError):
        return False
    return got.ids == blocks.ids and all(bytes(got.blocks[b].data) == bytes(blocks.blocks[b].data) for b in blocks.ids)


UCX_UNSTABLE = pytest.mark.xfail(strict=False, reason=(
    "UCX cells are timing-bound under heavy load: 2026-11-23 runs at load average 12-22 gave 20/20, 12/20 and "
    "19/20 XPASS (the one miss, desync-first-ucx, passed alone right after); failures are timeouts (a fault-free "
    "UCX peer 'took nothing for 4.0 s'), never a crash. Not yet reliable enough to gate CI; the cell still runs "
    "and reports XPASS when it holds; 2026-11-24 on a quiet machine: 20/20 in one run, then throttle-middle-ucx "
    "took 21.2 s against a 14.1 s bound in `make chaos` run alone"))


@pytest.mark.parametrize("transport", ["tcp", pytest.param("ucx", marks=UCX_UNSTABLE)])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("fault", FAULTS)
def test_fault(tmp_path: Path, harness: ModuleType, chaos_blocks: BlockSet, baselines: dict[str, float],
               transport: str, position: str, fault: str) -> None:
    _transport_ok(transport)
    if transport not in baselines:
        took, codes, _ = _run(harness, tmp_path / "baseline", chaos_blocks, transport, None, None, {})
        assert all(code == 0 for code in codes.values()), f"fault-free baseline failed: {codes}"
        assert all(_identical(tmp_path / "baseline", t, chaos_blocks) for t in TARGETS)
        baselines[transport] = took
    victim = POSITIONS[position]
    summaries: dict[str, dict[str, object]] = {}
    took, codes, c = _run(harness, tmp_path / "run", chaos_blocks, transport, fault, victim, summaries)
    logs = {i: c.log(i) for i in ("s0", *TARGETS)}  # type: ignore[attr-defined]
    everything = "\n".join(logs.values())
    t_out = TIMEOUTS[transport]
    bound = baselines[transport] + 2 * t_out + (1.5 * t_out if fault == "stop" else 0.0)
    assert took <= bound, f"took {took:.1f} s, bound {bound:.1f} s (baseline {baselines[transport]:.1f} s); {codes}"
    recovered = any(sm.get("refetches") or sm.get("downstreamLost") for sm in summaries.values())
    if recovered or fault == "kill" or any(code != 0 for code in codes.values()):
        assert re.search(NAMED[fault], everything), f"no named {fault} failure in the logs:\n{everything[-3000:]}"
    for sm in summaries.values():  # every drop says why
        assert all(str(why).startswith(("lost:", "lagging:")) for why in dict(sm["downstreamLost"]).values()), sm
    for t in TARGETS:
        if fault == "kill" and t == victim:
            continue
        if fault == "kill" and victim == "s0" and codes[t] != 0:
            # nothing left to recover from: the target fails, and says why
            assert codes[t] not in (0, None) and "no fallback could provide" in logs[t], logs[t][-2000:]
            continue
        assert codes[t] == 0, f"{t} exited {codes[t]}:\n{logs[t][-2000:]}"
        assert _identical(tmp_path / "run", t, chaos_blocks), f"{t} is not byte-identical"
