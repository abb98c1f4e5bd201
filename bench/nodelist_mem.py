#!/usr/bin/env python3
"""Operator memory of the node list at fleet scale: one unpaged list (what nodefacts did before) against the
list read in pages of 500 and slimmed page by page (nodefacts.list_all), each in a fresh process.

The node body is a real one: a KWOK node as this repository's control plane serves it (kubectl create, KWOK's
status, the node controller: managedFields of the three; tests/data/kwok-node.json), copied `--nodes` times
with distinct names. The API server's answer is served as the bytes the operator's client reads
(kube.py: `resp.read()` then `json.loads`), a page or the whole list at a time. Printed per mode: the
process's peak RSS during the list (VmHWM) and its RSS after, minus the same before the list; and the slim
nodes kept. Writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

SAMPLE = Path(__file__).resolve().parents[1] / "tests" / "data" / "kwok-node.json"


def _mem() -> dict[str, float]:
    kb = {k: float(v.split()[0]) for k, v in (ln.split(":", 1) for ln in Path("/proc/self/status").read_text()
                                              .splitlines()) if k in ("VmRSS", "VmHWM")}
    return {k: v / 1024 for k, v in kb.items()}


class Server:
    """The list as the API server pages it, as bytes (built once, before the measurement starts)."""

    def __init__(self, n: int, page: int) -> None:
        base = json.loads(SAMPLE.read_text())
        items = []
        for i in range(n):
            node = copy.deepcopy(base)
            node["metadata"]["name"] = node["metadata"]["labels"]["kubernetes.io/hostname"] = f"scale-gpu-{i}"
            items.append(node)
        self.pages = [json.dumps({"metadata": {"resourceVersion": "7", "continue": str(i + page) if i + page < n
                                               else ""}, "items": items[i:i + page]}).encode()
                      for i in range(0, n, page)]
        self.whole = json.dumps({"metadata": {"resourceVersion": "7"}, "items": items}).encode()

    async def list_nodes_page(self, limit: int, cont: str = "") -> tuple[list[dict[str, Any]], str, str]:
        doc = json.loads(self.pages[int(cont or 0) // limit])
        return doc["items"], doc["metadata"]["resourceVersion"], doc["metadata"]["continue"]


def one(mode: str, n: int) -> dict[str, float]:
    from kascade_operator import nodefacts
    from kascade_operator.nodefacts import NodeFacts

    server = Server(n, nodefacts.LIST_PAGE)
    facts = NodeFacts("kascade.io/leaf", "nvidia.com/gpu")
    if mode == "paged":
        del server.whole
    else:
        server.pages.clear()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    m0 = _mem()
    if mode == "paged":
        asyncio.run(facts.list_all(server))
    else:  # the old way: the whole answer, parsed at once, slimmed after
        doc = json.loads(server.whole)
        facts.replace(doc["items"], doc["metadata"]["resourceVersion"])
        del doc
    m1 = _mem()
    return {"nodes": float(len(facts.nodes)), "peak_mb": round(m1["VmHWM"] - m0["VmRSS"], 1),
            "after_mb": round(m1["VmRSS"] - m0["VmRSS"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=10000)
    ap.add_argument("--mode", choices=("paged", "whole"), help=argparse.SUPPRESS)  # one measurement (subprocess)
    a = ap.parse_args()
    if a.mode:
        print(json.dumps(one(a.mode, a.nodes)))
        return
    size = len(json.dumps(json.loads(SAMPLE.read_text())))
    print(f"node list of {a.nodes} nodes ({size} B of JSON each), RSS above the process before the list:")
    print(f"{'mode':>8} {'peak MB':>9} {'after MB':>9} {'nodes kept':>11}")
    for mode in ("whole", "paged"):
        out = subprocess.run([sys.executable, __file__, "--mode", mode, "--nodes", str(a.nodes)],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out)
        print(f"{mode:>8} {r['peak_mb']:9.1f} {r['after_mb']:9.1f} {r['nodes']:11.0f}")


if __name__ == "__main__":
    main()
