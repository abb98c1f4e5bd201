"""Host memory of processes and of the node, read from /proc (Linux), in MiB: what the node cache's benchmark
and tests compare (issue 35 item 3).

Per process (`proc_mem`): /proc/<pid>/status RssAnon (private memory: a private host copy of a model shows
here), RssFile (file pages mapped: checkpoints, libraries), RssShmem (shared-memory pages mapped: the node's copy
of a model in a tmpfs file) and VmRSS; /proc/<pid>/smaps_rollup Pss (each page divided among the processes
mapping it, so the Pss of N processes sums to their memory counted once). Per node: the bytes of the files in a
memory-backed directory (`dir_mib`: a tmpfs file is resident in full, mapped or not) and /proc/meminfo Shmem.
"""

from __future__ import annotations

from pathlib import Path

KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _kib(text: str, key: str) -> int:
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def proc_mem(pid: int) -> dict[str, float]:
    """MiB of VmRSS, RssAnon, RssFile, RssShmem and Pss of process `pid`."""
    status = Path(f"/proc/{pid}/status").read_text()
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    return {k: _kib(status, k) / 1024 for k in KEYS} | {"Pss": _kib(rollup, "Pss") / 1024}


def node_shmem_mib() -> float:
    return _kib(Path("/proc/meminfo").read_text(), "Shmem") / 1024


def dir_mib(path: Path | str) -> float:
    """MiB of the regular files directly in `path` (a tmpfs directory: memory the node holds)."""
    return sum(p.stat().st_size for p in Path(path).iterdir() if p.is_file()) / (1 << 20)
