"""Engine stand-ins (tests/operator/enginestub.py) in processes of their own, for the scale bench.

At 2,000 nodes / 200 services the bench's own process (kubectl calls, /metrics polling, JSON of 2,000 nodes)
and 200+ stand-in HTTP servers shared one interpreter lock: under load a stand-in missed the plan driver's
5 s reachability window, its pod was dropped as unhealthy and the set-up never reached 200/200. Here the
stand-ins live in `procs` child processes (spawned, each an interpreter of its own); the bench talks to them
over a pipe: `RemoteStub` has the attributes the scale bench uses (instance, endpoint, calls, tokens_per_s,
close). Times in `calls` are CLOCK_MONOTONIC, shared by every process of the machine.

Data flow: StubHost(path, names, token, procs) -> child `_serve` makes its EngineStubs, sends their endpoints
-> the bench sets a stub's tokens_per_s / reads its calls (one pipe round trip each) -> close() stops the
children.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any


def _serve(conn: Connection, path: str, names: list[str], model: str, token: str) -> None:
    spec = importlib.util.spec_from_file_location("enginestub", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stubs = {n: mod.EngineStub(n, model, token) for n in names}
    conn.send({n: s.endpoint for n, s in stubs.items()})
    while True:
        try:
            cmd, name, arg = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            break
        s = stubs[name]
        if cmd == "rate":
            s.tokens_per_s = float(arg)
            conn.send(None)
        elif cmd == "calls":  # verbs and times, not bodies (a bind body is small, but 200 stubs polled 10/s add up)
            with s._lock:
                conn.send([(v, {}, t) for v, _, t in s.calls if t >= arg])
    for s in stubs.values():
        s.close()


class RemoteStub:
    def __init__(self, host: StubHost, k: int, instance: str, endpoint: str) -> None:
        self._host, self._k, self.instance, self.endpoint = host, k, instance, endpoint
        self._rate = 0.0

    @property
    def calls(self) -> list[tuple[str, dict[str, Any], float]]:
        out: list[tuple[str, dict[str, Any], float]] = self._host.ask(self._k, "calls", self.instance, 0.0)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self._rate

    @tokens_per_s.setter
    def tokens_per_s(self, rate: float) -> None:
        self._host.ask(self._k, "rate", self.instance, rate)
        self._rate = rate

    def count(self, verb: str) -> int:
        return sum(1 for v, _, _ in self.calls if v == verb)

    def close(self) -> None:
        self._host.close()


class StubHost:
    def __init__(self, path: Path, names: list[str], token: str, procs: int = 2, model: str = "tiny") -> None:
        ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        parts = [names[i::procs] for i in range(procs)]
        for part in parts:
            a, b = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(b, str(path), part, model, token), daemon=True)
            p.start()
            self._conns.append(a)
            self._procs.append(p)
        self.stubs: list[RemoteStub] = []
        where: dict[str, RemoteStub] = {}
        for k, conn in enumerate(self._conns):
            for n, ep in conn.recv().items():
                where[n] = RemoteStub(self, k, n, ep)
        self.stubs = [where[n] for n in names]  # in the caller's order
        self.closed = False

    def ask(self, k: int, cmd: str, name: str, arg: Any) -> Any:
        with self._lock:
            self._conns[k].send((cmd, name, arg))
            return self._conns[k].recv()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("close", "", None))
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
