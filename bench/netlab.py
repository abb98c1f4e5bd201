"""Emulated hosts for benchmarks: network namespaces on one bridge, each link rate-limited with tbf.

Data flow: `NetLab(n, rate_mbit)` -> namespaces kb-h0..kb-h{n-1}, each with a veth whose host side
and switch side both get a tbf qdisc (upload and download capped), joined by a bridge in kb-sw ->
`prefix(i)` to run a command inside host i, `addr(i)` its address. Everything is deleted on exit.
Needs root and a kernel with network namespaces; netem is not needed (this kernel lacks it).
With `groups=2, spine_ratio=r` the hosts form two "leaves" (group A: hosts 0..n/2-1 at 10.213.0.x,
group B at 10.213.0.128+x): each link's cross-group traffic, per direction, is capped at r x its rate
(htb: a cross class matched by the other group's /25, beside the in-group class), which is how the
planner's cost model sees an oversubscribed spine: every GPU link's share of its leaf's uplink.
"""

from __future__ import annotations

import subprocess

PREFIX = "kb"


def _run(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {proc.stderr.strip()}")


# A link's queue, in milliseconds at its rate. TCP keeps whatever queue a link has full, and a relay
# chain pays it once per hop; datacenter switch buffers hold well under a millisecond at 100 Gbit/s.
# 10 ms (tbf's minimum sensible at these rates with a 256 KiB burst) keeps each hop's queueing small
# beside a block's transfer time, as on real fabrics; 50 ms made an 8-hop chain ~10 % late.
QUEUE_MS = 10

class NetLab:
    def __init__(self, hosts: int, rate_mbit: int = 200, groups: int = 1, spine_ratio: float = 1.0,
                 prefix: str = PREFIX) -> None:
        if groups not in (1, 2) or not 0 < spine_ratio <= 1:
            raise ValueError(f"groups must be 1 or 2 and spine_ratio in (0, 1], got {groups}, {spine_ratio}")
        self.hosts, self.rate, self.groups, self.spine = hosts, rate_mbit, groups, spine_ratio
        self.tag = prefix

    def group(self, i: int) -> int:
        return 0 if self.groups == 1 or i < self.hosts // 2 else 1

    def addr(self, i: int) -> str:
        return f"10.213.0.{i + 1}" if self.group(i) == 0 else f"10.213.0.{129 + i - self.hosts // 2}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", f"{self.tag}-h{i}"]

    def _shape(self, ns: list[str], dev: str, other: str, direction: str) -> None:
        """htb: in-group traffic at the link rate, cross-group traffic at spine_ratio of it."""
        r, x = self.rate, max(1, int(self.rate * self.spine))
        _run(*ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        _run(*ns, "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{r}mbit",
             "ceil", f"{r}mbit", "burst", "256kb", "cburst", "256kb")
        _run(*ns, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:10", "htb", "rate",
             f"{max(1, r - x)}mbit", "ceil", f"{r}mbit", "burst", "256kb", "cburst", "256kb")
        _run(*ns, "tc", "class", "add", "dev", dev, "parent", "1:1", "classid", "1:20", "htb", "rate", f"{x}mbit",
             "ceil", f"{x}mbit", "burst", "256kb", "cburst", "256kb")
        _run(*ns, "tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "u32", "match", "ip",
             direction, other, "flowid", "1:20")
        # each class's queue holds at most QUEUE_MS at its rate, like tbf's `latency` on the one-group
        # links (htb's default leaf queue is 1,000 packets: 120 ms at 100 Mbit/s, added at every relay hop)
        for cls, mbit in (("10", r), ("20", x)):
            _run(*ns, "tc", "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle", f"{cls}:", "bfifo",
                 "limit", str(max(3000, mbit * 1_000_000 // 8 * QUEUE_MS // 1000)))

    def __enter__(self) -> NetLab:
        self.cleanup()
        tag = self.tag
        try:
            sw = ["ip", "netns", "exec", f"{tag}-sw"]
            _run("ip", "netns", "add", f"{tag}-sw")
            _run(*sw, "ip", "link", "add", f"{tag}-br", "type", "bridge")
            _run(*sw, "ip", "link", "set", f"{tag}-br", "up")
            tbf = ["tbf", "rate", f"{self.rate}mbit", "burst", "256kb", "latency", f"{QUEUE_MS}ms"]
            for i in range(self.hosts):
                h, v, p = f"{tag}-h{i}", f"{tag}-v{i}", f"{tag}-p{i}"
                _run("ip", "netns", "add", h)
                _run("ip", "link", "add", v, "type", "veth", "peer", "name", p)
                _run("ip", "link", "set", v, "netns", h)
                _run("ip", "link", "set", p, "netns", f"{tag}-sw")
                _run(*sw, "ip", "link", "set", p, "master", f"{tag}-br", "up")
                _run(*self.prefix(i), "ip", "addr", "add", f"{self.addr(i)}/24", "dev", v)
                _run(*self.prefix(i), "ip", "link", "set", v, "up")
                _run(*self.prefix(i), "ip", "link", "set", "lo", "up")
                if self.groups == 1:
                    _run(*self.prefix(i), "tc", "qdisc", "add", "dev", v, "root", *tbf)  # upload
                    _run(*sw, "tc", "qdisc", "add", "dev", p, "root", *tbf)  # download
                else:
                    other = "10.213.0.128/25" if self.group(i) == 0 else "10.213.0.0/25"
                    self._shape(self.prefix(i), v, other, "dst")  # upload
                    self._shape(sw, p, other, "src")  # download
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
            if name.startswith(f"{self.tag}-"):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)


def available() -> str | None:
    """None if namespaces with tbf can be made here, else the reason they cannot."""
    try:
        with NetLab(1):
            pass
    except (RuntimeError, FileNotFoundError) as e:
        return str(e)
    return None


