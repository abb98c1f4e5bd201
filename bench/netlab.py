"""Emulated hosts for benchmarks: network namespaces on one bridge, each link rate-limited with tbf.

Data flow: `NetLab(n, rate_mbit)` -> namespaces kb-h0..kb-h{n-1}, each with a veth whose host side
and switch side both get a tbf qdisc (upload and download capped), joined by a bridge in kb-sw ->
`prefix(i)` to run a command inside host i, `addr(i)` its address. Everything is deleted on exit.
Needs root and a kernel with network namespaces; netem is not needed (this kernel lacks it).
With `groups=2, spine_ratio=r` the hosts form two "leaves" (group A: hosts 0..n/2-1 at 10.213.0.x,
group B at 10.213.0.128+x): each link's cross-group traffic, per direction, is capped at r x its rate
(htb: a cross class beside the in-group class, one leaf per peer host under each, matched by the
peer's address), which is how the planner's cost model sees an oversubscribed spine: every GPU link's
share of its leaf's uplink, split evenly between the flows using it. This kernel has no fair-queueing
qdisc (sfq, fq, fq_codel), hence per-peer htb leaves.

QoS (one-group links): like a fabric configured for the engine's traffic classes, every link sends the
activation class (IP TOS 0x88, DSCP AF41: the engine's act-port connections, `kascade_engine.net.transport.
ACTIVATION`) ahead of everything else. Each link direction keeps the plain link's tbf (same rate, burst and
pacing) and queues under it in an htb with two classes: 2:10 activations (prio 0) and 2:20 bulk (weights,
HTTP, unmarked: prio 1), picked by a u32 filter on the TOS byte (ECN bits masked). The htb runs far faster
than the link, so it never shapes: whenever tbf may send, it sends the oldest activation packet if one
waits, else the oldest bulk packet. A weight stream therefore never queues ahead of a step's activations,
and bulk still gets the whole link when no activation waits. (This kernel has no `prio` qdisc; htb
priorities do the same here.) `qos=True` asks for it (bench/live.py --link-qos); the default keeps the plain FIFO (tbf)
links every bench was measured on. Two-group links with `qos=True` do the same under each per-peer leaf: the
leaf paces (its rate and ceiling unchanged) and an ordering htb under it sends the leaf's activation packets
before its bulk ones.
"""

from __future__ import annotations

import subprocess

from kascade_engine.net.transport import ACTIVATION

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
# TCP small queues: how many bytes one socket may have in its host's qdisc. This host's default is
# 4 MiB (~0.3 ms on a 100 Gbit/s NIC, 160 ms on an emulated 200 Mbit/s link), more than a 2:1-spine
# leaf's queue holds, so a socket overflowed its own host's queue (hundreds of local drops a run,
# each a congestion signal). 128 KiB: two 64 KiB GSO packets, a few ms at these rates.
TSQ_BYTES = 128 << 10
BURST = 256 << 10  # bytes an htb class may send at once (tbf's burst on the one-group links)
# The htb under a QoS link's tbf runs this many times faster than the link, so neither class ever waits
# for its own tokens: tbf paces, htb only orders (a slower htb shaped on its own and changed the link:
# with per-class buckets an idle activation class sent a 300 KB frame across a 7 Mbit/s hop in 10 ms).
INNER_X = 10
ACTIVATION_SHARE = 0.9  # of the htb's rate; both classes stay far above the link rate, so only prio counts
ACTIVATION_CLASS, BULK_CLASS = 10, 20  # htb minor class ids on a QoS link (major 2, under tbf's 1:)

# two-group QoS links: the handles of a leaf's activation and bulk queues are these plus the leaf's minor
# (tc reads handles as hex: 1099..1120 and 2099..2120 stay distinct from the leaves' 99..120 and below 0xffff)
LEAF_ACT, LEAF_BULK = 1000, 2000


def _ordering(dev: str, parent: str, handle: int, fast_kbit: int, queue: int, queues: tuple[int, int]) -> list[str]:
    """tc commands for an htb under `parent` (handle `handle`:) that only orders: activations (TOS 0x88,
    ECN bits masked; class handle:10, prio 0) before bulk (handle:20, prio 1), both far faster than what
    paces above it, so neither ever waits for its own tokens; each class's bfifo holds `queue` bytes and has
    the handle given in `queues` (activation, bulk)."""
    act = int(fast_kbit * ACTIVATION_SHARE)
    cmds = [f"qdisc add dev {dev} parent {parent} handle {handle}: htb default {BULK_CLASS}",
            f"class add dev {dev} parent {handle}: classid {handle}:1 htb rate {fast_kbit}kbit ceil {fast_kbit}kbit "
            f"burst {BURST}"]
    for minor, rate, prio, q in ((ACTIVATION_CLASS, act, 0, queues[0]), (BULK_CLASS, fast_kbit - act, 1, queues[1])):
        cmds += [f"class add dev {dev} parent {handle}:1 classid {handle}:{minor} htb rate {rate}kbit "
                 f"ceil {fast_kbit}kbit burst {BURST} cburst {BURST} prio {prio} quantum 30000",
                 f"qdisc add dev {dev} parent {handle}:{minor} handle {q}: bfifo limit {queue}"]
    cmds.append(f"filter add dev {dev} parent {handle}: protocol ip prio 1 u32 match ip tos {ACTIVATION.tos:#x} 0xfc "
                f"flowid {handle}:{ACTIVATION_CLASS}")
    return cmds


def _tc_batch(ns: list[str], dev: str, cmds: list[str]) -> None:
    """Run `cmds` (tc commands on `dev`) in one `tc -batch` inside namespace `ns`; the error names the device."""
    proc = subprocess.run([*ns, "tc", "-batch", "-"], input="\n".join(cmds) + "\n", capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"tc -batch on {dev}: {proc.stderr.strip()}")


class NetLab:
    def __init__(self, hosts: int, rate_mbit: int = 200, groups: int = 1, spine_ratio: float = 1.0,
                 prefix: str = PREFIX, qos: bool = False) -> None:
        if groups not in (1, 2) or not 0 < spine_ratio <= 1:
            raise ValueError(f"groups must be 1 or 2 and spine_ratio in (0, 1], got {groups}, {spine_ratio}")
        self.hosts, self.rate, self.groups, self.spine = hosts, rate_mbit, groups, spine_ratio
        self.tag, self.qos = prefix, qos

    def group(self, i: int) -> int:
        return 0 if self.groups == 1 or i < self.hosts // 2 else 1

    def addr(self, i: int) -> str:
        return f"10.213.0.{i + 1}" if self.group(i) == 0 else f"10.213.0.{129 + i - self.hosts // 2}"

    def prefix(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", f"{self.tag}-h{i}"]

    def _prioritise(self, ns: list[str], dev: str) -> None:
        """One-group link with QoS (module docstring): the plain link's tbf, and under it an htb that hands
        tbf the activation class (TOS 0x88) first. tbf alone sets the pace, with the plain links' rate and
        burst; the htb runs at INNER_X x the link rate, so both its classes always have tokens and its
        class priority alone decides the order (the strict priority a `prio` qdisc would give)."""
        r, queue = self.rate, self.rate * 1_000_000 // 8 * QUEUE_MS // 1000 + BURST  # tbf's limit on the plain links
        fast = r * INNER_X * 1000  # kbit/s
        cmds = [f"qdisc add dev {dev} root handle 1: tbf rate {r}mbit burst {BURST} latency {QUEUE_MS}ms",
                *_ordering(dev, "1:1", 2, fast, queue, (ACTIVATION_CLASS, BULK_CLASS))]
        _tc_batch(ns, dev, cmds)

    def class_bytes_by_id(self, i: int, side: str) -> dict[str, int]:
        """Bytes each htb class of host i's link has sent, by class id ("2:10"; the nested classes of a
        two-group QoS link's leaves included): side "up" or "down" as in `class_bytes`."""
        ns, dev = (self.prefix(i), f"{self.tag}-v{i}") if side == "up" else (
            ["ip", "netns", "exec", f"{self.tag}-sw"], f"{self.tag}-p{i}")
        out = subprocess.run([*ns, "tc", "-s", "class", "show", "dev", dev], capture_output=True, text=True,
                             check=True).stdout
        sent: dict[str, int] = {}
        cid = None
        for line in out.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                cid = words[2]
            elif words[:1] == ["Sent"] and cid is not None:
                sent[cid] = int(words[1])
        return sent

    def class_bytes(self, i: int, side: str) -> dict[int, int]:
        """Bytes each htb class of host i's link has sent, by minor (1:10 -> 10; tc reads and prints it as hex
        digits alike): side "up" (host i's veth) or "down" (the switch port towards host i). Tests read it to
        see which class a flow went through."""
        return {int(cid.split(":")[1]): n for cid, n in self.class_bytes_by_id(i, side).items()}

    def _shape(self, ns: list[str], dev: str, me: int, direction: str) -> None:
        """htb: in-group traffic at the link rate, cross-group traffic at spine_ratio of it, and one leaf
        class per peer host under each, so flows to (or from) different peers split what their class
        gets evenly, as the planner's cost model assumes (a FIFO left the split to TCP: the host's
        congestion control is BBR, which over a few seconds splits a shared FIFO unevenly; a cross-group
        stripe capped at its exact share could never make up what its upstream in-group hop lost).
        With QoS each leaf's queue is an ordering htb (`_ordering`: activations first, then bulk) instead
        of one FIFO: the leaf still paces, so the link's and the spine's rates are unchanged."""
        r, x = self.rate, max(1, int(self.rate * self.spine))
        peers = [i for i in range(self.hosts) if i != me]
        inside = [i for i in peers if self.group(i) == self.group(me)]
        cross = [i for i in peers if self.group(i) != self.group(me)]
        cmds = [
            f"qdisc add dev {dev} root handle 1: htb default 99",
            f"class add dev {dev} parent 1: classid 1:1 htb rate {r}mbit ceil {r}mbit burst {BURST} cburst {BURST}",
            f"class add dev {dev} parent 1:1 classid 1:10 htb rate {max(1, r - x)}mbit ceil {r}mbit "
            f"burst {BURST} cburst {BURST}",
            f"class add dev {dev} parent 1:1 classid 1:20 htb rate {x}mbit ceil {x}mbit burst {BURST} cburst {BURST}",
        ]
        # (leaf minor, parent minor, parent's rate and ceiling, peer or None for unmatched traffic, e.g. ARP)
        leaves = [(99, 10, max(1, r - x), r, None)]
        leaves += [(100 + i, 10, max(1, r - x), r, i) for i in inside]
        leaves += [(100 + i, 20, x, x, i) for i in cross]
        share = {10: len(inside) + 1, 20: max(1, len(cross))}
        for minor, parent, rate, ceil, peer in leaves:
            # equal guarantees and quanta: siblings borrow the parent's spare rate in equal parts
            cmds.append(f"class add dev {dev} parent 1:{parent} classid 1:{minor} htb "
                        f"rate {max(1, rate * 1000 // share[parent])}kbit ceil {ceil}mbit "
                        f"burst {BURST} cburst {BURST} quantum 30000")
            # each leaf's queue holds at most QUEUE_MS at its ceiling plus the upstream shaper's
            # burst, like tbf's `limit` on the one-group links (htb's default leaf queue is 1,000
            # packets: 120 ms at 100 Mbit/s, added at every relay hop; a queue shorter than the burst
            # the sending side's shaper releases at once dropped whole bursts: thousands of
            # retransmitted segments a run)
            limit = ceil * 1_000_000 // 8 * QUEUE_MS // 1000 + BURST
            if self.qos:  # the leaf paces; under it, the activation class goes first (as on a one-group QoS link)
                cmds += _ordering(dev, f"1:{minor}", minor, ceil * INNER_X * 1000, limit,
                                  (LEAF_ACT + minor, LEAF_BULK + minor))
            else:
                cmds.append(f"qdisc add dev {dev} parent 1:{minor} handle {minor}: bfifo limit {limit}")
            if peer is not None:
                cmds.append(f"filter add dev {dev} parent 1: protocol ip prio 1 u32 match ip {direction} "
                            f"{self.addr(peer)}/32 flowid 1:{minor}")
        _tc_batch(ns, dev, cmds)

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
                if self.groups == 2:
                    _run(*self.prefix(i), "sysctl", "-qw", f"net.ipv4.tcp_limit_output_bytes={TSQ_BYTES}")
                if self.groups == 1 and self.qos:
                    self._prioritise(self.prefix(i), v)  # upload
                    self._prioritise(sw, p)  # download
                elif self.groups == 1:
                    _run(*self.prefix(i), "tc", "qdisc", "add", "dev", v, "root", *tbf)  # upload
                    _run(*sw, "tc", "qdisc", "add", "dev", p, "root", *tbf)  # download
                else:
                    self._shape(self.prefix(i), v, i, "dst")  # upload
                    self._shape(sw, p, i, "src")  # download
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


