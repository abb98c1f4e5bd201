"""Node cache: one host copy of a model per node, mapped by every engine on the node that needs it (issue 35
item 3, ADR 16).

The copy is a host-cache file (`hostcache.py` layout: header + 4 KiB-aligned verified blocks) in a directory on a
memory-backed file system shared by the node's engine pods (`/dev/shm/kascade` on the host, mounted into each
pod). An engine maps it copy-on-write (`hostcache.open_cache`: MAP_PRIVATE): the pages are the file system's, shared
by every mapping on the node, and no engine can change the copy another maps (a write, which the engine does not
make, would copy that page privately). Host memory grows with the models a node caches, not with its replicas.

Who may drop a copy is settled by `flock`: an engine holds a shared lock on the file for as long as it maps it
(`Lease`); eviction takes an exclusive lock without waiting, so a copy in use is never removed, and a crashed
engine's lock goes with its process (no reference count to repair). Eviction is by demand: under the node's
budget, the copies no engine maps go first, least recently attached first.

Writers: one per model per node (an exclusive `flock` on `.<file>.lock`, held while writing); the copy is
written under `<file>.tmp` and renamed in place once complete (hostcache.py writes its completion marker last),
so a reader never sees half a copy. A crashed writer's `.tmp` (its lock went with its process) is found and
removed by the next `publish` or `clean` (`stale`). A damaged or mismatched copy is removed by `discard` when
no engine maps it (the engine side, nodecopy.py, decides that it is damaged or mismatched).

Data flow: an engine holding a verified `BlockSet` -> `publish` (once per model per node: written to a temporary
name, renamed in place; evicts unused copies to fit the budget, or refuses with the reason) -> other engines
`attach(model)` -> `Lease.blocks` (a `BlockSet` of zero-copy views; `Block.tensors()` views them) -> `Lease.close()`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kascade_engine.weights.blocks import BlockSet
from kascade_engine.weights.hostcache import open_cache, write_cache

log = logging.getLogger(__name__)
SUFFIX = ".kcache"
TMP = ".tmp"  # hostcache.write_cache's temporary name: <file>.tmp


def _file_name(model: str) -> str:
    if not model:
        raise ValueError("model must be non-empty")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model)
    # a model name with other characters (org/name) gets a stable suffix so two names never share a file
    return f"{safe}-{hashlib.sha256(model.encode()).hexdigest()[:8]}{SUFFIX}" if safe != model else f"{safe}{SUFFIX}"


@dataclass(frozen=True)
class Entry:
    model_file: str
    bytes: int
    in_use: bool
    attached_s: float  # last attach (the file's access time as the cache sets it)


class Lease:
    """A mapped copy and the shared lock that keeps it from eviction. Close it when the engine drops the copy."""

    def __init__(self, fd: int, path: Path, blocks: BlockSet) -> None:
        self._fd: int | None = fd
        self.path = path
        self.blocks = blocks

    def close(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class NodeCache:
    def __init__(self, root: Path | str, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes

    def path(self, model: str) -> Path:
        return self.root / _file_name(model)

    def entries(self) -> list[Entry]:
        out = []
        for p in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append(Entry(p.name, st.st_size, self._in_use(p), st.st_atime))
        return out

    def used_bytes(self) -> int:
        """Bytes of the node's copies and of copies being written (both are host memory)."""
        tmp = 0
        for p in self.root.glob(f"*{SUFFIX}{TMP}"):
            with contextlib.suppress(FileNotFoundError):
                tmp += p.stat().st_size
        return sum(e.bytes for e in self.entries()) + tmp

    def _lock_path(self, model_file: str) -> Path:
        return self.root / f".{model_file}.lock"

    def stale(self) -> list[Path]:
        """Temporary files no writer holds: left by a writer that crashed (its lock went with its process)."""
        return self._sweep(remove=False)

    def clean(self) -> list[str]:
        """Remove crashed writers' leftovers (`stale`); names removed."""
        return [p.name for p in self._sweep(remove=True)]

    def _sweep(self, remove: bool) -> list[Path]:
        out = []
        for tmp in sorted(self.root.glob(f"*{SUFFIX}{TMP}")):
            fd = os.open(self._lock_path(tmp.name.removesuffix(TMP)), os.O_CREAT | os.O_WRONLY, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if remove:  # under the writers' lock: no writer can start this file meanwhile
                    tmp.unlink()
                    log.warning("node cache: removed %s, left by a writer that did not finish", tmp)
                out.append(tmp)
            except (BlockingIOError, FileNotFoundError):
                continue  # being written now, or removed by another engine
            finally:
                os.close(fd)
        return out

    def discard(self, model: str) -> bool:
        """Remove the node's copy of `model` (damaged or not the model's: nodecopy.py) unless an engine maps it."""
        p = self.path(model)
        with self._exclusive(p) as free:
            if not free:
                return False
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                return True
            return False

    @classmethod
    def _in_use(cls, p: Path) -> bool:
        with cls._exclusive(p) as free:
            return free is False

    @staticmethod
    @contextlib.contextmanager
    def _exclusive(p: Path) -> Iterator[bool | None]:
        """Try `p`'s exclusive lock without waiting: None, no such file; False, an engine maps it (holds a shared
        lock); True, held here until the block ends (closing the descriptor drops it)."""
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def attach(self, model: str, verify: bool = False) -> Lease | None:
        """Map the node's copy of `model` (None when the node has none)."""
        p = self.path(model)
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_ino != os.stat(p).st_ino:  # evicted and re-published between open and lock
                raise FileNotFoundError(p)
            blocks = open_cache(p, verify=verify)
            now = time.time()
            os.utime(p, (now, os.stat(p).st_mtime))  # the attach time orders eviction
        except FileNotFoundError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        return Lease(fd, p, blocks)

    def evict(self, need_bytes: int = 0, keep: str | None = None) -> list[str]:
        """Drop unused copies, least recently attached first, until `need_bytes` more fit the budget."""
        dropped = []
        keep_name = _file_name(keep) if keep else None
        for e in sorted(self.entries(), key=lambda e: (e.attached_s, e.model_file)):
            if self.used_bytes() + need_bytes <= self.budget:
                break
            if e.in_use or e.model_file == keep_name:
                continue
            p = self.root / e.model_file
            fd = os.open(p, os.O_RDONLY)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                p.unlink()
                dropped.append(e.model_file)
            except (BlockingIOError, FileNotFoundError):
                continue  # attached meanwhile, or dropped by another engine
            finally:
                os.close(fd)
        return dropped

    def publish(self, blocks: BlockSet) -> tuple[bool, str]:
        """Keep `blocks` as the node's copy of its model: (True, "") when the node has it now (written here or
        already there), (False, why) when the budget cannot hold it even with every unused copy dropped."""
        p = self.path(blocks.model)
        if p.exists():
            return True, ""
        self.clean()
        size = blocks.total_bytes + 64 * 1024  # header and alignment
        self.evict(size, keep=blocks.model)
        if self.used_bytes() + size > self.budget:
            return False, (f"node cache budget {self.budget / 1e6:.1f} MB cannot hold {blocks.model} "
                           f"({blocks.total_bytes / 1e6:.1f} MB) beside the copies in use "
                           f"({self.used_bytes() / 1e6:.1f} MB)")
        # one writer per model per node; the lock goes with its process (a crashed writer leaves no stale lock)
        fd = os.open(self._lock_path(p.name), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False, f"another engine of this node is writing {blocks.model}'s copy"
        try:
            if not p.exists():
                write_cache(p, blocks)
        finally:
            os.close(fd)
        return True, ""
