"""The engine's HTTP answers leave in its latency class: the tokens a serving source streams to its clients go
up the same link as the weights it sends a loading target, and unmarked they queued behind them (bench live,
ADR 0007: ~0.3 s on every first token a source streamed while its weight stream kept
the link's queue full, the tail of ZigZag's TTFT).

- `serving_socket`: the listener, and every connection it accepts, carries the class (IP TOS); None: unmarked.
- A real `kascade engine serve`: the server end of an HTTP connection to it carries TOS 0x88 (AF41) by
  default, and nothing with `--activation-dscp 0` (read from the kernel with `ss --tos`).
- On the benchmarks' emulated links (bench/netlab.py, QoS): behind a weight stream that fills host 0's
  upload queue, answers from a marked listener arrive in a few ms, from an unmarked one after the queue."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kascade_engine.net.transport import ACTIVATION, serving_socket

ECN = 0x03  # the TOS byte's two low bits belong to ECN, not to the class


def _accepted_tos(mark: object) -> tuple[int, int]:
    """(listener's TOS, an accepted connection's TOS) of a `serving_socket` with `mark`."""
    lst = serving_socket("127.0.0.1", 0, mark)  # type: ignore[arg-type]
    try:
        client = socket.create_connection(lst.getsockname()[:2], timeout=5)
        try:
            conn, _ = lst.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # answers are never held for Nagle
                return (lst.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) & ~ECN,
                        conn.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) & ~ECN)
        finally:
            client.close()
    finally:
        lst.close()


def test_serving_socket_marks_every_connection_it_accepts() -> None:
    assert _accepted_tos(ACTIVATION) == (ACTIVATION.tos, ACTIVATION.tos)
    assert _accepted_tos(None) == (0, 0)


def test_serving_socket_names_the_address_it_could_not_bind() -> None:
    with serving_socket("127.0.0.1", 0, None) as taken, pytest.raises(OSError):
        serving_socket("127.0.0.1", taken.getsockname()[1], None)


# -- a real engine -------------------------------------------------------------------------------------

def _engine(tmp: Path, *flags: str) -> Iterator[int]:
    from kascade_devcluster.localengine import start_engine
    from kascade_engine.weights.checkpoint import tiny_llama

    ckpt = tiny_llama(tmp / "tiny-tos", layers=1, hidden=32, vocab=128)
    e = start_engine(["--checkpoint", str(ckpt), "--empty", "--host", "127.0.0.1", *flags], "t")
    try:
        yield e.http
    finally:
        e.stop()


def _server_tos(port: int) -> int:
    """The TOS of the engine's end of an open HTTP connection (one answered request, kept alive)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
        c.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert c.recv(4096).startswith(b"HTTP/1.1 "), "the engine did not answer"
        out = subprocess.run(["ss", "-Htn", "--tos", "state", "established", f"( sport = :{port} )"],
                             capture_output=True, text=True, check=True).stdout
        m = re.search(r"tos:(0x[0-9a-f]+|\d+)", out)
        assert m, f"ss shows no tos for the engine's connection: {out!r}"
        return int(m.group(1), 0) & ~ECN


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a socket's TOS")
@pytest.mark.parametrize(("flags", "tos"), [((), ACTIVATION.tos), (("--activation-dscp", "0"), 0)])
def test_a_real_engine_answers_http_in_its_latency_class(tmp_path: Path, flags: tuple[str, ...], tos: int) -> None:
    for port in _engine(tmp_path, *flags):
        assert _server_tos(port) == tos


# -- why: the emulated links ---------------------------------------------------------------------------



# host 0: a weight stream to host 1 (unmarked, as the engine's weight transport) and a server answering each
# 8-byte request with 200 bytes (a token's SSE event) on a serving_socket marked as argv[3] says
SOURCE = """
import socket, sys, threading
from kascade_engine.net.transport import ACTIVATION, serving_socket
addr, sink, marked = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
def weights():
    s = socket.create_connection((sink, 9001))
    chunk = b"w" * 65536
    while True:
        s.sendall(chunk)
threading.Thread(target=weights, daemon=True).start()
lst = serving_socket(addr, 9000, ACTIVATION if marked else None)
print("up", flush=True)
conn, _ = lst.accept()
while (req := conn.recv(8)):
    conn.sendall(b"a" * 200)
"""
SINK = """
import socket, sys
lst = socket.create_server((sys.argv[1], 9001))
print("up", flush=True)
conn, _ = lst.accept()
while conn.recv(1 << 20):
    pass
"""
# the client: once the weight stream's slow start has filled the link's queue (0.5 s in), 12 requests 20 ms apart;
# their round trips. (Later the stream's first losses may drain the queue for a while: unmarked answers then
# wait 15-90 ms, bench live's sources 0.01-0.1 s.)
CLIENT = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], 9000))
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
time.sleep(0.5)
for _ in range(12):
    t = time.perf_counter()
    c.sendall(b"r" * 8)
    got = 0
    while got < 200:
        got += len(c.recv(200 - got))
    print(time.perf_counter() - t, flush=True)
    time.sleep(0.02)
"""


def _round_trips(netlab: ModuleType, marked: bool) -> list[float]:
    lab = netlab.NetLab(3, rate_mbit=7, prefix=f"ks{secrets.token_hex(2)}", qos=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs: list[subprocess.Popen[str]] = []
    with lab:
        try:
            for host, code, args in (
                (1, SINK, [lab.addr(1)]),
                (0, SOURCE, [lab.addr(0), lab.addr(1), str(int(marked))]),
            ):
                p = subprocess.Popen([*lab.prefix(host), sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                                     text=True, env=env)
                procs.append(p)
                assert p.stdout is not None and p.stdout.readline().strip() == "up"
            out = subprocess.run([*lab.prefix(2), sys.executable, "-c", CLIENT, lab.addr(0)], capture_output=True,
                                 text=True, env=env, timeout=60, check=True).stdout
        finally:
            for p in procs:
                p.kill()
                p.wait(10)
    return [float(x) for x in out.split()]


@pytest.mark.netns
def test_on_a_link_full_of_weights_marked_answers_skip_the_queue(netlab: ModuleType) -> None:
    """7 Mbit/s (the live bench's links): the weight stream's slow start fills host 0's upload queue (~0.3 s: 10 ms
    plus the 256 KiB burst). Unmarked, an answer waits that queue; marked (the engine's HTTP listener now), it
    goes first and waits at most the bulk packet being sent (measured: 20-40 ms against 0.26-0.32 s unmarked)."""
    unmarked, marked = _round_trips(netlab, False), _round_trips(netlab, True)
    assert statistics.median(unmarked[:3]) > 0.15, unmarked
    assert max(marked) < 0.1, marked
