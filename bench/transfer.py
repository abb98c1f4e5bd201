#!/usr/bin/env python3
"""Data-plane benchmark, every number measured side by side in one run.

1. Loopback: one relay hop (the transfer protocol: framing, cut-through, digest, commit) against the
   raw transport streaming the same bytes between two processes -> `loopback_hop_over_raw_{tcp,ucx}`.
2. Emulated hosts (network namespaces, veth, tbf at 200 Mbit/s up and down per host): a 1->N chain for
   N = 1, 2, 4, 8 and, for N = 8, star and binomial plans from the planner; the planner's predicted
   time beside each measurement -> `chain8_over_chain1`, `star8_over_chain8`, `min_link_utilization`,
   `measured_over_predicted_chain8`. Skipped, saying why, where namespaces cannot be made.
Writes bench/results/transfer.json. `--quick` uses less data (< 1 minute).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netlab
from report import report

from kascade_devcluster.ports import free_ports
from kascade_engine.blocks import Block, BlockSet, digest_of
from kascade_engine.hostcache import write_cache
from kascade_engine.transfer_spec import TransferSpec
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


def run_transfer(plan: Plan, blocks: BlockSet, work: Path, transport: str, chunk: int,
                 hosts: dict[str, tuple[list[str], str]]) -> dict[str, dict[str, float]]:
    """Run every participant as a process (inside its namespace prefix) and return target summaries."""
    ids = [i.id for i in (*plan.sources, *plan.targets)]
    ports = free_ports(len(ids))
    peers = {i: (hosts[i][1], p) for i, p in zip(ids, ports, strict=True)}
    not_before = time.time() + 3.0 + 0.15 * len(ids)  # every process imported and listening by then
    spec = TransferSpec(plan, blocks.manifest(), peers, secrets.token_hex(8), chunk, 30.0, {}, not_before)
    (work / "spec.json").write_text(json.dumps(spec.to_dict()))
    cache = work / "src.kcache"
    if not cache.exists():
        write_cache(cache, blocks)
    procs = {}
    for i in ids:
        args = [*hosts[i][0], sys.executable, "-m", "kascade_cli.main", "transfer", "run", "--spec",
                str(work / "spec.json"), "--me", i, "--transport", transport]
        args += ["--cache", str(cache), "--linger", "60"] if i in {s.id for s in plan.sources} else ["--linger", "2"]
        procs[i] = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    out = {}
    try:
        for t in plan.targets:
            stdout, _ = procs[t.id].communicate(timeout=300)
            if procs[t.id].returncode != 0:
                raise RuntimeError(f"{t.id} failed")
            out[t.id] = {**json.loads(stdout.strip().splitlines()[-1]), "notBefore": not_before}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


RAW = """
import asyncio, json, sys, time
from kascade_engine.hostcache import open_cache
from kascade_engine.transport import make_transport
mode, name, host, port, cache, chunk = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
blocks = open_cache(cache)
total = blocks.total_bytes
async def main():
    t = make_transport(name)
    if mode == "recv":
        done = asyncio.get_running_loop().create_future()
        dest = memoryview(bytearray(total))  # fresh memory, as a relay target fills fresh block buffers
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
    time.sleep(1.0 if transport == "tcp" else 2.5)
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


def emulated(blocks: BlockSet, chunk: int, rate_mbit: int, work: Path) -> dict[str, float]:
    n_hosts = 9
    topo = Topology(tuple(Node(f"h{i}", "leaf", f"h{i}", 1, rate_mbit / 1000) for i in range(n_hosts)))
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
            return measured, plan.completion, res

        chain = {}
        for n in (1, 2, 4, 8):
            chain[n] = measure("chain", n)
            out[f"chain{n}_s"], out[f"chain{n}_predicted_s"] = chain[n][0], chain[n][1]
        star = measure("star", 8)
        binom = measure("binomial", 8)
        out["star8_s"], out["star8_predicted_s"] = star[0], star[1]
        out["binomial8_s"], out["binomial8_predicted_s"] = binom[0], binom[1]
        out["chain8_over_chain1"] = chain[8][0] / chain[1][0]
        out["star8_over_chain8"] = star[0] / chain[8][0]
        out["binomial8_over_chain8"] = binom[0] / chain[8][0]
        out["measured_over_predicted_chain8"] = chain[8][0] / chain[8][1]
        rate = rate_mbit * 1e6 / 8
        out["min_link_utilization"] = min(r["bytesReceived"] / (rate * (r["doneAt"] - r["firstByteAt"]))
                                          for r in chain[8][2].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rate-mbit", type=int, default=200)
    args = ap.parse_args()
    out: dict[str, float | str] = {}
    loop_total = (128 if args.quick else 512) << 20
    net_total = (12 if args.quick else 48) << 20
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        loop_blocks = synthetic_blocks(loop_total, 16)
        for transport in ("tcp", "ucx"):
            chunk = 4 << 20
            (work / f"loop-{transport}").mkdir()
            hop = hop_throughput(transport, loop_blocks, chunk, work / f"loop-{transport}")
            raw = raw_throughput(transport, work / f"loop-{transport}" / "src.kcache", chunk)
            out[f"loopback_raw_MBps_{transport}"] = raw / 1e6
            out[f"loopback_hop_MBps_{transport}"] = hop / 1e6
            out[f"loopback_hop_over_raw_{transport}"] = hop / raw
            print(f"loopback {transport}: raw {raw / 1e6:8.1f} MB/s   relay hop {hop / 1e6:8.1f} MB/s   ratio {hop / raw:.2f}",
                  flush=True)
        out["loopback_hop_over_raw"] = min(float(out["loopback_hop_over_raw_tcp"]), float(out["loopback_hop_over_raw_ucx"]))
        reason = netlab.available()
        if reason:
            print(f"SKIPPED emulated links: cannot create network namespaces here ({reason})")
            out["emulated_skipped"] = reason
        else:
            print(f"emulated hosts: 9 namespaces, tbf {args.rate_mbit} Mbit/s per direction, {net_total >> 20} MiB model")
            (work / "net").mkdir()
            out.update(emulated(synthetic_blocks(net_total, 16), 128 << 10, args.rate_mbit, work / "net"))
    report("transfer", out, {"chain8_over_chain1": ("<=", 1.15), "min_link_utilization": (">=", 0.90),
                             "loopback_hop_over_raw": (">=", 0.80)})

if __name__ == "__main__":
    main()
