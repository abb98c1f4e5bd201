"""The fault matrix (`make chaos`): every fault at every position of a 1->3 chain, over both transports,
on real transfer processes (`kascade transfer run`), ends in bounded time with every surviving target
byte-identical and every failure named in the logs.

Faults: SIGKILL; SIGSTOP for 1.5 x timeoutSeconds then SIGCONT; a connection cut mid-stream; a stream
desync (a frame read short, so the next header starts inside a payload; at the source: a chunk sent to
the wrong offset); a throttle (a relay forwards at a tenth of the chain's rate, the last node reads at
that rate or, over TCP, at whatever rate empties its receive buffer within timeoutSeconds if that is
faster, the source sends at half its pace: slower, nothing to drop). Positions: source s0, first t0,
middle t1, last t2 of s0 -> t0 -> t1 -> t2.
"The chain's rate" is what the fault-free baseline on the same transport moved (first byte to last
block), capped at the source's pace. On a 2-core machine the chain is CPU-bound well below that pace
(measured: UCX ~9 MB/s, TCP ~13 MB/s against a 45 MB/s pace), and a tenth of the pace was only about half
the UCX chain's rate. A relay whose downstream is only ~2x slower than itself is kept waiting about half
the time, right at the lag threshold (forwarding.py), and so is the relay above it: which of the two
dropped its downstream first was a coin flip. When the upper one won, the throttled relay re-fetched
from the source and forwarded that to its own downstream at the throttled rate (a re-fetch is forwarded
without the lag rule): throttle-middle-ucx took 21-35 s against a ~16 s bound. A tenth of the measured
rate keeps the throttled relay waiting ~90% of the time, and its queue fills seconds before the queue of
the relay above it: it drops its downstream first.
Bound: the run ends within 2 x timeoutSeconds (+ the pause itself for SIGSTOP) past a fault-free
baseline run measured first on the same transport. The chain is CPU-bound on 2 shared cores, so its speed
moves with the machine's load over the minutes a module takes: a cell that overruns a baseline measured
earlier is held to a fresh baseline measured right after it (the fault run is not repeated, the margin is
not widened: only the reference is taken again, beside the run it judges). The source lingers (it is every
target's fallback);
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

from kascade_devcluster.requirement import need_transport
from kascade_engine.weights.blocks import Block, BlockSet, digest_of
from kascade_engine.weights.hostcache import open_cache
from kascade_planner.builder import make_plan
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import leaf_spine

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

TIMEOUTS = {"tcp": 2.0, "ucx": 4.0}  # timeoutSeconds: UCX connection setup (peer-info exchange) alone
# took up to ~3 s on the loaded 2-core dev machines
# Bytes a slow-reading last node still reads after its upstream dropped it, before it sees the reset: TCP's
# receive buffer (transport_tcp asks for 4 MiB, Linux doubles it); UCX cancels the pending receive at once.
RECV_BUFFERED = {"tcp": 8 << 20, "ucx": 0}
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
    plan = make_plan(
        topo, model, [Instance("s0", nodes[0])], [Instance(t, nodes[i + 1]) for i, t in enumerate(TARGETS)], "chain"
    )
    assert plan.chains == (("s0", *TARGETS),)
    return plan


def _faults(fault: str, victim: str, total: int, transport: str = "tcp",
            chain_mbps: float | None = None) -> dict[str, dict[str, object]]:
    """Per-node faults; `chain_mbps`: the fault-free chain's measured rate (the throttles are relative to it)."""
    rate = total / BASE_SECONDS / 1e6
    chain = min(rate, chain_mbps or rate)
    # The slow last node must get through what its kernel already buffered within timeoutSeconds once its
    # upstream drops it (at a tenth of the TCP chain's rate that alone took 7 s: 10.8 s against 11.0).
    last = max(chain / 10, RECV_BUFFERED[transport] / 1e6 / TIMEOUTS[transport])
    f: dict[str, dict[str, object]] = {"s0": {"rateMBps": rate}}
    third = total // 3
    if victim == "s0":
        f["s0"].update({"cut": {"cutAfterBytes": third}, "desync": {"desyncAfterBytes": third},
                        "throttle": {"rateMBps": rate / 2}}.get(fault, {}))
    else:  # throttle: a relay forwards at a tenth of the chain's rate; the last node reads that slowly
        slow = {"recvRateMBps": last} if victim == TARGETS[-1] else {"rateMBps": chain / 10}
        # an inbound cut fires early in the stream (after the first block): later, a relay's slow moment can
        # get it dropped as lagging first and then pull the rest, where no push is left to cut (seen once,
        # cut-middle-ucx on a loaded 2-core box); the desync keeps the third
        f[victim] = {"cut": {"cutInboundAfterBytes": total // 6}, "desync": {"desyncInboundAfterBytes": third},
                     "throttle": slow}.get(fault, {})
    return f


def _run(harness: ModuleType, workdir: Path, blocks: BlockSet, transport: str, fault: str | None,
         victim: str | None, summaries: dict[str, dict[str, object]],
         chain_mbps: float | None = None, first_block_s: float = 30.0) -> tuple[float, dict[str, int | None], object]:
    """Run the chain with the fault; returns (seconds until the last process ended, exit codes, cluster).
    `first_block_s`: how long the watched node may take to log its first block before the fault is injected."""
    workdir.mkdir(parents=True, exist_ok=True)
    c = harness.make_cluster(
        workdir,
        blocks,
        _plan(blocks),
        transport=transport,
        chunk=CHUNK[transport],
        faults=_faults(fault, victim, blocks.total_bytes, transport, chain_mbps)
        if fault and victim
        else _faults("none", "s0", blocks.total_bytes),
        timeout_s=TIMEOUTS[transport],
    )
    c.target_linger = 0.0
    t0 = time.monotonic()
    c.start_all()
    try:
        if fault in ("kill", "stop") and victim:
            watch = "t0" if victim == "s0" else victim  # mid-transfer: the watched node holds a first block
            harness.wait_for(lambda: f'"instance": "{watch}", "block"' in c.log(watch), timeout=first_block_s)
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


@pytest.fixture(autouse=True)
def _free_disk(tmp_path: Path):
    """Each cell leaves ~0.5 GB of 64 MiB block caches; pytest keeps every cell's tmp_path until the session
    ends, so the matrix would hold ~20 GB at once (a shared dev disk filled up). Logs stay for reading."""
    yield
    for f in tmp_path.rglob("*"):
        if f.is_file() and f.stat().st_size > (1 << 20):
            f.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def baselines() -> dict[str, tuple[float, float]]:
    """transport -> (seconds the fault-free run took, the chain's rate in MB/s), measured once per module."""
    return {}


def _chain_mbps(summaries: dict[str, dict[str, object]], total: int) -> float:
    """Bytes over the time from the first target's first byte to the last target's last block (wall clock,
    comparable across processes): what the fault-free chain moved, without process start-up."""
    first = min(float(str(sm["firstByteAt"])) for sm in summaries.values())
    done = max(float(str(sm["doneAt"])) for sm in summaries.values())
    return total / max(done - first, 1e-3) / 1e6


def _identical(workdir: Path, target: str, blocks: BlockSet) -> bool:
    try:
        got = open_cache(workdir / f"{target}.kcache", verify=True)
    except (OSError, ValueError):
        return False
    return got.ids == blocks.ids and all(bytes(got.blocks[b].data) == bytes(blocks.blocks[b].data) for b in blocks.ids)


def _baseline(harness: ModuleType, workdir: Path, blocks: BlockSet, transport: str) -> tuple[float, float]:
    """A fault-free run: (seconds it took, the chain's rate in MB/s)."""
    fault_free: dict[str, dict[str, object]] = {}
    took, codes, _ = _run(harness, workdir, blocks, transport, None, None, fault_free)
    assert all(code == 0 for code in codes.values()), f"fault-free baseline failed: {codes}"
    assert all(_identical(workdir, t, blocks) for t in TARGETS)
    return took, _chain_mbps(fault_free, blocks.total_bytes)


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("position", list(POSITIONS))
@pytest.mark.parametrize("fault", FAULTS)
def test_fault(tmp_path: Path, harness: ModuleType, chaos_blocks: BlockSet, baselines: dict[str, tuple[float, float]],
               transport: str, position: str, fault: str) -> None:
    need_transport(transport)
    if transport not in baselines:
        baselines[transport] = _baseline(harness, tmp_path / "baseline", chaos_blocks, transport)
    base_s, chain_mbps = baselines[transport]
    victim = POSITIONS[position]
    summaries: dict[str, dict[str, object]] = {}
    # the first block comes after the processes start and connect, which this run's fault-free baseline measured:
    # a fixed 30 s was too short once for UCX on a loaded machine (its baseline took 18 s there)
    first_block_s = max(30.0, 3 * base_s)
    took, codes, c = _run(harness, tmp_path / "run", chaos_blocks, transport, fault, victim, summaries, chain_mbps,
                          first_block_s)
    logs = {i: c.log(i) for i in ("s0", *TARGETS)}  # type: ignore[attr-defined]
    everything = "\n".join(logs.values())
    t_out = TIMEOUTS[transport]
    margin = 2 * t_out + (1.5 * t_out if fault == "stop" else 0.0)
    bound = base_s + margin
    if took > bound:  # the baseline may be stale (see the module docstring): the fault-free chain again, now
        stale = base_s
        base_s, chain_mbps = baselines[transport] = _baseline(harness, tmp_path / "baseline-now", chaos_blocks,
                                                              transport)
        bound = base_s + margin
        print(f"{fault}-{position}-{transport}: over the bound of a baseline of {stale:.1f} s; measured again: "
              f"{base_s:.1f} s")
    print(f"{fault}-{position}-{transport}: took {took:.1f} s, bound {bound:.1f} s (baseline {base_s:.1f} s, "
          f"chain {chain_mbps:.1f} MB/s)")  # the margin, for -s / -rP
    assert took <= bound, (f"took {took:.1f} s, bound {bound:.1f} s (baseline {base_s:.1f} s, chain "
                           f"{chain_mbps:.1f} MB/s); {codes}")
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
