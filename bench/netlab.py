"""Emulated hosts for benchmarks: network namespaces on one bridge, each link rate-limited with tbf.

Data flow: `NetLab(n, rate_mbit)` -> namespaces kb-h0..kb-h{n-1}, each with a veth whose host side
and switch side both get a tbf qdisc (upload and download capped), joined by a bridge in kb-sw ->
`prefix(i)` to run a command inside host i, `addr(i)` its address. Everything is deleted on exit.
Needs root and a kernel with network namespaces; netem is not needed (this kernel lacks it).
"""

from __future__ import annotations

import subprocess

PREFIX = "kb"


def _run(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip()}")


class NetLab:
    def __init__(self, hosts: int, rate_mbit: int = 200) -> None:
        self.hosts, self.rate = hosts, rate_mbit

    def addr(self, i: int) -> str:
        return f"10.213.0.{i + 1}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", f"{PREFIX}-h{i}"]

    def __enter__(self) -> NetLab:
        self.cleanup()
        try:
            sw = ["ip", "netns", "exec", f"{PREFIX}-sw"]
            _run("ip", "netns", "add", f"{PREFIX}-sw")
            _run(*sw, "ip", "link", "add", f"{PREFIX}-br", "type", "bridge")
            _run(*sw, "ip", "link", "set", f"{PREFIX}-br", "up")
            tbf = ["tbf", "rate", f"{self.rate}mbit", "burst", "256kb", "latency", "50ms"]
            for i in range(self.hosts):
                h, v, p = f"{PREFIX}-h{i}", f"{PREFIX}-v{i}", f"{PREFIX}-p{i}"
                _run("ip", "netns", "add", h)
                _run("ip", "link", "add", v, "type", "veth", "peer", "name", p)
                _run("ip", "link", "set", v, "netns", h)
                _run("ip", "link", "set", p, "netns", f"{PREFIX}-sw")
                _run(*sw, "ip", "link", "set", p, "master", f"{PREFIX}-br", "up")
                _run(*self.prefix(i), "ip", "addr", "add", f"{self.addr(i)}/24", "dev", v)
                _run(*self.prefix(i), "ip", "link", "set", v, "up")
                _run(*self.prefix(i), "ip", "link", "set", "lo", "up")
                _run(*self.prefix(i), "tc", "qdisc", "add", "dev", v, "root", *tbf)  # upload
                _run(*sw, "tc", "qdisc", "add", "dev", p, "root", *tbf)  # download
        except Exception:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split()[0] if line.strip() else ""
            if name.startswith(f"{PREFIX}-"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


def available() -> str | None:
    """None if namespaces with tbf can be made here, else the reason they cannot."""
    try:
        with NetLab(1):
            pass
    except (RuntimeError, FileNotFoundError) as e:
        return str(e)
    return None


