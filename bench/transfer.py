#!/usr/bin/env python3
"""Data-plane benchmark, every number measured side by side in one run.

1. Loopback: one relay hop (the transfer protocol: framing, cut-through, digest, commit) against the
   raw transport streaming the same bytes between two processes -> `loopback_hop_over_raw_{tcp,ucx}`.
   Both receivers write into memory faulted in before the first byte (raw: a zero-filled buffer;
   relay: its receive arena, populated ahead of the stream), runs interleaved, medians compared.
2. Emulated hosts (network namespaces, veth, tbf at 200 Mbit/s up and down per host): a 1->N chain for
   N = 1, 2, 4, 8 and, for N = 8, star, binomial and hybrid plans from the planner; the planner's
   predicted time beside each measurement -> `chain8_over_chain1`, `star8_over_chain8`,
   `min_link_utilization`, `measured_over_predicted_chain8` (from `notBefore`) and, per plan kind,
   `measured_over_predicted_on_wire_{chain8,binomial8,hybrid8}` (first byte to last completion).
3. A 2:1 spine (two groups of namespaces, cross-group traffic capped at half of each link): an
   unstriped chain against the hybrid plan's stripes -> `spine_striped_over_chain`,
   `measured_over_predicted_on_wire_spine_{chain7,hybrid7}`. 2 and 3 are skipped, saying why, where
   namespaces cannot be made.
Writes bench/results/transfer.json. `--quick` uses less data (< 1 minute). `--only spine` (or
`loopback`, `emulated`) runs one section alone and writes bench/results/transfer-spine.json (etc.).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab
from report import report

from kascade_devcluster.ports import free_ports
from kascade_engine.net.transfer_spec import TransferSpec
from kascade_engine.weights.blocks import Block, BlockSet, digest_of
from kascade_engine.weights.hostcache import write_cache
from kascade_planner.builder import make_plan
from kascade_planner.cost import CostParams
from kascade_planner.plan import Instance, ModelLayout, Plan
from kascade_planner.topology import Node, Topology

ENV = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}


def synthetic_blocks(total: int, n: int) -> BlockSet:
    rng = os.urandom
    blocks = []
    for i in range(n):
        data = memoryview(bytearray(rng(total // n)))
        blocks.append(Block(f"b{i}", data, (), digest_of(data)))
    return BlockSet("synthetic", {}, blocks)


def on_wire_s(res: dict[str, dict[str, float]]) -> float:
    """From the first byte any target received to the last target's completion: the transfer itself,
    without the sources' start-up lag past `notBefore` (seconds of imports on a loaded machine)."""
    return max(r["doneAt"] for r in res.values()) - min(r["firstByteAt"] for r in res.values())


def run_transfer(plan: Plan, blocks: BlockSet, work: Path, transport: str, chunk: int,
                 hosts: dict[str, tuple[list[str], str]]) -> dict[str, dict[str, float]]:
    """Run every participant as a process (inside its namespace prefix) and return target summaries.

    Targets start first; once every one of them has its receive arena reserved (memory faulted in,
    as the raw receiver's buffer is), the sources start with a `notBefore` just ahead of their own
    start-up, so the timed part never includes an importing peer or a page fault the raw run lacks.
    """
    source_ids = [s.id for s in plan.sources]
    ids = [*source_ids, *(t.id for t in plan.targets)]
    ports = free_ports(len(ids))
    peers = {i: (hosts[i][1], p) for i, p in zip(ids, ports, strict=True)}
    token = secrets.token_hex(8)
    cache = work / "src.kcache"
    if not cache.exists():
        write_cache(cache, blocks)

    def spec_file(name: str, not_before: float | None) -> Path:
        spec = TransferSpec(plan, blocks.manifest(), peers, token, chunk, 30.0, {}, not_before)
        (work / name).write_text(json.dumps(spec.to_dict()))
        return work / name

    def start(i: str, spec: Path, extra: list[str]) -> subprocess.Popen[str]:
        args = [*hosts[i][0], sys.executable, "-m", "kascade_cli.main", "transfer", "run", "--spec", str(spec),
                "--me", i, "--transport", transport, *extra]
        with open(work / f"{i}.log", "w") as log:  # the child keeps its own copy of the descriptor
            return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=ENV)

    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        targets_spec = spec_file("targets.json", None)
        for t in plan.targets:
            procs[t.id] = start(t.id, targets_spec, ["--linger", "0.3"])  # (pulls only after a failure)
        deadline = time.monotonic() + 60
        for t in plan.targets:
            while '"reserved"' not in (work / f"{t.id}.log").read_text():
                if procs[t.id].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{t.id} never got ready: {(work / f'{t.id}.log').read_text()[-1000:]}")
                time.sleep(0.02)
        not_before = time.time() + 0.6 + 0.3 * len(source_ids)  # a source imports and maps its cache in ~0.3 s
        sources_spec = spec_file("sources.json", not_before)
        for i in source_ids:
            procs[i] = start(i, sources_spec, ["--cache", str(cache), "--linger", "60"])
        out = {}
        for t in plan.targets:
            stdout, _ = procs[t.id].communicate(timeout=300)
            if procs[t.id].returncode != 0:
                raise RuntimeError(f"{t.id} failed: {(work / f'{t.id}.log').read_text()[-1000:]}")
            out[t.id] = {**json.loads(stdout.strip().splitlines()[-1]), "notBefore": not_before}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


RAW = """
import asyncio, json, sys, time
from kascade_engine.weights.hostcache import open_cache
from kascade_engine.net.transports import make_transport
mode, name, host, port, cache, chunk = (
    sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
)
blocks = open_cache(cache)
total = blocks.total_bytes
async def main():
    t = make_transport(name)
    if mode == "recv":
        done = asyncio.get_running_loop().create_future()
        dest = memoryview(bytearray(total))  # faulted in before the first byte, as the relay's arena is
        async def handler(conn):
            n, first = 0, None
            while True:
                h, plen = await conn.recv_header(timeout=60)
                if h["op"] == "end":
                    break
                first = first or time.time()
                await conn.recv_into(dest[n:n + plen], timeout=60)
                n += plen
            done.set_result({"bytes": n, "firstByteAt": first, "doneAt": time.time()})
        lst = await t.listen(host, port, handler)
        print(json.dumps(await done), flush=True)
        await lst.close()
    else:
        for _ in range(200):
            try:
                conn = await t.connect(host, port)
                break
            except Exception:
                await asyncio.sleep(0.05)
        for b in blocks.blocks.values():  # the same bytes the relay's source sends, from the same cache
            for off in range(0, b.nbytes, chunk):
                await conn.send({"op": "chunk", "block": b.id, "offset": off}, b.data[off:off + chunk])
        await conn.send({"op": "end"})
        await asyncio.sleep(0.5)
        await conn.close()
asyncio.run(main())
"""


def raw_throughput(transport: str, cache: Path, chunk: int) -> float:
    """The bare transport moving the same bytes from the same host-cache file into fresh memory:
    no protocol, no cut-through bookkeeping, no digests."""
    (port,) = free_ports(1)
    args = [transport, "127.0.0.1", str(port), str(cache), str(chunk)]
    recv = subprocess.Popen([sys.executable, "-c", RAW, "recv", *args], stdout=subprocess.PIPE, text=True, env=ENV)
    time.sleep(0.5 if transport == "tcp" else 1.0)  # the sender retries its connect meanwhile
    send = subprocess.Popen([sys.executable, "-c", RAW, "send", *args], env=ENV)
    out, _ = recv.communicate(timeout=300)
    send.wait(timeout=60)
    r = json.loads(out.strip().splitlines()[-1])
    return float(r["bytes"] / (r["doneAt"] - r["firstByteAt"]))


def hop_throughput(transport: str, blocks: BlockSet, chunk: int, work: Path) -> float:
    topo = Topology((Node("a", "l", "a", 1, 100), Node("b", "l", "b", 1, 100)))
    model = ModelLayout("synthetic", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    plan = make_plan(topo, model, [Instance("s0", "a")], [Instance("t0", "b")], "chain", predict=False)
    local = {i: ([], "127.0.0.1") for i in ("s0", "t0")}
    r = run_transfer(plan, blocks, work, transport, chunk, local)["t0"]
    return float(r["bytesReceived"] / (r["doneAt"] - r["firstByteAt"]))


def goodput_gbps(rate_mbit: int) -> float:
    """What a TCP stream carries over a link shaped to `rate_mbit` (tbf/htb count whole frames): a
    1,448-byte payload (MSS with timestamps) per 1,514-byte Ethernet frame, 95.6 %. The planner is told
    this rate, as an operator would give it a fabric's usable rate; `min_link_utilization` still
    divides by the shaped rate, so it shows the overhead."""
    return rate_mbit / 1000 * 1448 / 1514


def emulated(blocks: BlockSet, chunk: int, rate_mbit: int, work: Path) -> dict[str, float]:
    n_hosts = 9
    topo = Topology(tuple(Node(f"h{i}", "leaf", f"h{i}", 1, goodput_gbps(rate_mbit)) for i in range(n_hosts)))
    model = ModelLayout("synthetic", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
    cost = CostParams(chunk_bytes=chunk, hop_latency_s=2e-4)
    out: dict[str, float] = {}
    with netlab.NetLab(n_hosts, rate_mbit) as lab:
        hosts = {f"h{i}": (lab.prefix(i), lab.addr(i)) for i in range(n_hosts)}

        def measure(alg: str, n: int) -> tuple[float, float, dict[str, dict[str, float]]]:
            src = [Instance("s0", "h0")]
            tgt = [Instance(f"t{i}", f"h{i + 1}") for i in range(n)]
            plan = make_plan(topo, model, src, tgt, alg, cost=cost)
            where = {"s0": hosts["h0"], **{t.id: hosts[t.node] for t in tgt}}
            d = work / f"{alg}{n}"
            d.mkdir()
            res = run_transfer(plan, blocks, d, "tcp", chunk, where)
            measured = max(r["doneAt"] for r in res.values()) - next(iter(res.values()))["notBefore"]
            refetches = sum(int(r["refetches"]) for r in res.values())
            print(f"  {alg:<9} 1->{n}: measured {measured:7.3f} s   predicted {plan.completion:7.3f} s"
                  + (f"   ({refetches} re-fetches: a participant stalled)" if refetches else ""), flush=True)
            out[f"{alg}{n}_on_wire_s"] = on_wire_s(res)
            return measured, plan.completion, res

        chain = {}
        for n in (1, 2, 4, 8):
            chain[n] = measure("chain", n)
            out[f"chain{n}_s"], out[f"chain{n}_predicted_s"] = chain[n][0], chain[n][1]
        star = measure("star", 8)
        binom = measure("binomial", 8)
        hybrid = measure("hybrid", 8)
        out["star8_s"], out["star8_predicted_s"] = star[0], star[1]
        out["binomial8_s"], out["binomial8_predicted_s"] = binom[0], binom[1]
        out["hybrid8_s"], out["hybrid8_predicted_s"] = hybrid[0], hybrid[1]
        out["chain8_over_chain1"] = chain[8][0] / chain[1][0]
        out["star8_over_chain8"] = star[0] / chain[8][0]
        out["binomial8_over_chain8"] = binom[0] / chain[8][0]
        out["measured_over_predicted_chain8"] = chain[8][0] / chain[8][1]
        # Per plan kind, on the wire (start-up lag excluded; the prediction's first hop is ~1 chunk).
        for kind, (_, predicted, _) in (("chain8", chain[8]), ("binomial8", binom), ("hybrid8", hybrid)):
            out[f"measured_over_predicted_on_wire_{kind}"] = out[f"{kind}_on_wire_s"] / predicted
        rate = rate_mbit * 1e6 / 8
        out["min_link_utilization"] = min(r["bytesReceived"] / (rate * (r["doneAt"] - r["firstByteAt"]))
                                          for r in chain[8][2].values())
    return out


def spine(blocks: BlockSet, chunk: int, rate_mbit: int, work: Path) -> dict[str, float]:
    """Two groups of 4 namespaces ("leaves") behind a 2:1 spine: each link's cross-group traffic is
    capped at half its rate. One source in group A, 7 targets (3 in A, 4 in B). An unstriped chain
    crosses once, at the capped rate; the hybrid plan pulls 2 stripes into group B through 2
    different members (each within its link's spine share) and exchanges them inside B."""
    n_hosts, ratio = 8, 0.5
    with netlab.NetLab(n_hosts, rate_mbit, groups=2, spine_ratio=ratio, prefix="kbs") as lab:
        topo = Topology(tuple(Node(f"h{i}", f"leaf-{lab.group(i)}", f"h{i}", 1, goodput_gbps(rate_mbit))
                              for i in range(n_hosts)), inter_leaf_ratio=ratio)
        model = ModelLayout("synthetic", blocks.ids, tuple(b.nbytes for b in blocks.blocks.values()))
        cost = CostParams(chunk_bytes=chunk, hop_latency_s=2e-4)
        hosts = {f"h{i}": (lab.prefix(i), lab.addr(i)) for i in range(n_hosts)}
        src = [Instance("s0", "h0")]
        tgt = [Instance(f"t{i}", f"h{i + 1}") for i in range(n_hosts - 1)]
        out: dict[str, float] = {}
        for alg in ("chain", "hybrid"):
            plan = make_plan(topo, model, src, tgt, alg, cost=cost)
            where = {"s0": hosts["h0"], **{t.id: hosts[t.node] for t in tgt}}
            d = work / f"spine-{alg}"
            d.mkdir()
            res = run_transfer(plan, blocks, d, "tcp", chunk, where)
            measured = on_wire_s(res)
            print(f"  {alg:<9} 1->7 over a 2:1 spine: measured {measured:7.3f} s on the wire   "
                  f"predicted {plan.completion:7.3f} s", flush=True)
            out[f"spine_{alg}7_s"], out[f"spine_{alg}7_predicted_s"] = measured, plan.completion
            out[f"measured_over_predicted_on_wire_spine_{alg}7"] = measured / plan.completion
        out["spine_striped_over_chain"] = out["spine_hybrid7_s"] / out["spine_chain7_s"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate-mbit", type=int, default=200)
    ap.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="loopback runs per transport, the median reported (default 3 with --quick, else 9: on 2 cores one UCX "
        "run swings 0.6-1.0 GB/s with whatever else runs, and 5 runs left the median at its mercy)",
    )
    ap.add_argument("--skip-loopback", action="store_true", help="only the emulated-link sections (2 and 3)")
    ap.add_argument("--only", choices=("loopback", "emulated", "spine", "tp"), default=None,
                    help="run one section alone: loopback (1), emulated (2: chain/star/binomial/hybrid 1->8) "
                         "or spine (3: the 2:1 spine), or tp (4: sharded into a TP-2 target, bench/tptransfer.py; "
                         "only with --only); bars whose numbers were not measured are not checked")
    args = ap.parse_args()
    out: dict[str, float | str] = {}
    run = {"loopback", "emulated", "spine"} if args.only is None else {args.only}
    if args.skip_loopback:
        run.discard("loopback")
    args.repeats = args.repeats if args.repeats is not None else 3 if args.quick else 9
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    loop_total = (512 if args.quick else 1024) << 20  # ~0.2-0.4 s a run: long enough to measure
    net_total = (12 if args.quick else 48) << 20
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if "loopback" in run:
            loop_blocks = synthetic_blocks(loop_total, 16)
            print(f"loopback: {loop_total >> 20} MiB in 16 blocks, 4 MiB chunks; relay hop and raw transport "
                  f"interleaved, median of {args.repeats}", flush=True)
        chunk = 4 << 20
        d = work / "loop"  # one host-cache file for every run (written once, then in the page cache)
        d.mkdir()
        for transport in ("tcp", "ucx") if "loopback" in run else ():
            hops, raws = [], []
            for r in range(args.repeats):  # interleaved, so a noisy moment hurts both sides alike
                hops.append(hop_throughput(transport, loop_blocks, chunk, d))
                raws.append(raw_throughput(transport, d / "src.kcache", chunk))
                print(f"  {transport} #{r + 1}: raw {raws[-1] / 1e6:8.1f} MB/s   relay hop {hops[-1] / 1e6:8.1f} MB/s",
                      flush=True)
            hop, raw = statistics.median(hops), statistics.median(raws)
            out[f"loopback_raw_MBps_{transport}"] = raw / 1e6
            out[f"loopback_hop_MBps_{transport}"] = hop / 1e6
            out[f"loopback_hop_over_raw_{transport}"] = hop / raw
            pairs = sorted(h / w for h, w in zip(hops, raws, strict=True))  # the noise, shown beside the ratio
            out[f"loopback_pair_ratio_min_{transport}"], out[f"loopback_pair_ratio_max_{transport}"] = (
                pairs[0],
                pairs[-1],
            )
            print(
                f"loopback {transport}: raw {raw / 1e6:8.1f} MB/s   relay hop {hop / 1e6:8.1f} MB/s   ratio "
                f"{hop / raw:.2f} "
                f"(single pairs {pairs[0]:.2f}-{pairs[-1]:.2f})",
                flush=True,
            )
        if "loopback" in run:
            out["loopback_hop_over_raw"] = min(float(out["loopback_hop_over_raw_tcp"]),
                                               float(out["loopback_hop_over_raw_ucx"]))
        reason = netlab.available() if run & {"emulated", "spine"} else None
        if reason:
            print(f"SKIPPED emulated links: cannot create network namespaces here ({reason})")
            out["emulated_skipped"] = reason
        elif run & {"emulated", "spine"}:
            (work / "net").mkdir()
            # 64 KiB chunks: each extra hop adds one chunk's time on the link (2.6 ms at 200 Mbit/s).
            net_blocks = synthetic_blocks(net_total, 16)
            if "emulated" in run:
                print(f"emulated hosts: 9 namespaces, tbf {args.rate_mbit} Mbit/s per direction, "
                      f"{net_total >> 20} MiB model")
                out.update(emulated(net_blocks, 64 << 10, args.rate_mbit, work / "net"))
            if "spine" in run:
                print("2:1 spine: 2 groups of 4 namespaces, cross-group traffic capped at half of each link")
                out.update(spine(net_blocks, 64 << 10, args.rate_mbit, work / "net"))
        if "tp" in run:  # --only tp: sharded transfer into a TP-2 target (bench/tptransfer.py)
            import tptransfer

            why = netlab.available()
            if why:
                print(f"SKIPPED tp: cannot create network namespaces here ({why})")
                out["tp_skipped"] = why
            else:
                (work / "tp").mkdir()
                out.update(tptransfer.tp_section(synthetic_blocks(net_total, 12), 1 << 20, args.rate_mbit, work / "tp"))
    ratios = [float(v) for k, v in out.items() if k.startswith("measured_over_predicted_on_wire")]
    if ratios:  # every plan kind's measured/predicted within 0.9-1.1
        out["measured_over_predicted_max_deviation"] = max(abs(r - 1) for r in ratios)
    # A single section writes its own file, so results/transfer.json always holds a whole run.
    report("transfer" if args.only is None else f"transfer-{args.only}", out,
           {"chain8_over_chain1": ("<=", 1.15), "min_link_utilization": (">=", 0.90),
            "loopback_hop_over_raw": (">=", 0.80), "spine_striped_over_chain": ("<=", 0.9),
            "measured_over_predicted_max_deviation": ("<=", 0.10), **tptransfer_targets()})

def tptransfer_targets() -> dict[str, tuple[str, float]]:
    import tptransfer

    return dict(tptransfer.TARGETS)


if __name__ == "__main__":
    main()
