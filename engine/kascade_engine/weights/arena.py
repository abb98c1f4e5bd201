"""Receive arena: memory for the blocks a node will receive, reserved ahead of the stream.

Why: a chunk written into fresh anonymous memory page-faults once per 4 KiB page, and on the dev VMs
those faults run at ~1.5 GB/s, slower than loopback TCP itself (~2.5 GB/s): a receiver that allocates
as bytes arrive spends more time faulting than receiving. A GPU engine's weight memory exists (and for
RDMA is registered, which also faults it in) before the first byte lands; the arena does the same for
host buffers.

Data flow: `ReceiveArena([(block, bytes), ...])` in the order blocks will arrive -> `start()`: a
background thread maps one anonymous region per block and populates it
(`madvise(MADV_POPULATE_WRITE)` through ctypes, which releases the GIL, so the event loop keeps
receiving meanwhile) -> `take(block)` hands the region out as a writable memoryview (torch views it
without copying). A block the stream reaches before the thread does is mapped at once and faults
lazily as it fills: correct either way, only slower (~1.5 GB/s here). A block the thread is populating
right then is waited for: faulting it again in the receiving thread would cost as long and double the
work. `ready` is set once every block is reserved (the node reports it; the benchmark starts its
sources after it, so relay and raw transport both write into faulted-in memory). Memory is released
when the last view of a block is dropped (the arena keeps no reference once `close()`d).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import mmap
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)
MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without writing them


class ReceiveArena:
    def __init__(self, order: Sequence[tuple[str, int]]) -> None:
        self.order = [(b, n) for b, n in order if n > 0]
        self._regions: dict[str, mmap.mmap] = {}
        # The thread publishes, the loop may map first: one region per block.
        self._lock = threading.Condition()
        self._populating: str | None = None
        self._closed = threading.Event()
        self.ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.populated = 0  # blocks populated by the thread before the stream needed them
        self.populate_s = 0.0

    def start(self) -> None:
        if not self.order:
            self.ready.set()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._reserve_all, name="kascade-arena", daemon=True)
            self._thread.start()

    def take(self, block: str, nbytes: int) -> memoryview:
        """The block's region (reserved ahead if the thread got there first)."""
        with self._lock:
            while self._populating == block:
                self._lock.wait(timeout=1.0)
            region = self._regions.get(block)
            if region is None:
                region = self._regions[block] = _anonymous(nbytes)
        if len(region) != nbytes:
            raise ValueError(f"block {block!r} was reserved with {len(region)} bytes, asked for {nbytes}")
        return memoryview(region)

    def close(self) -> None:
        """Stop reserving; regions already handed out stay valid for as long as their views live."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self._regions.clear()

    def _reserve_all(self) -> None:
        t0 = time.monotonic()
        try:
            self._reserve_blocks()
        finally:
            self.populate_s = time.monotonic() - t0
            self.ready.set()  # done, whether every block was populated or the rest will fault lazily
            log.debug("arena: %d of %d blocks populated ahead in %.3f s", self.populated, len(self.order),
                      self.populate_s)

    def _reserve_blocks(self) -> None:
        for block, nbytes in self.order:
            if self._closed.is_set():
                return
            with self._lock:
                if block in self._regions:  # the stream got there first: it faults that block itself
                    continue
                self._populating = block
            # Populated before it is published, so nothing else ever writes a region being populated.
            ok = False
            try:
                region = _anonymous(nbytes)
                ok = _populate(region)
            finally:
                with self._lock:
                    self._populating = None
                    if ok and self._regions.setdefault(block, region) is region:
                        self.populated += 1
                    self._lock.notify_all()
            if not ok:
                return  # out of memory or not supported: the rest faults lazily


def _anonymous(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


@functools.cache
def _madvise() -> Any:
    """libc's madvise, declared once (ctypes calls it without the GIL)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def _populate(region: mmap.mmap) -> bool:
    """Fault every page of `region` in, without holding the GIL. False when the rest should not try."""
    anchor = ctypes.c_char.from_buffer(region)  # an export: the region cannot be unmapped meanwhile
    try:
        addr, size = ctypes.addressof(anchor), len(region)
        if sys.platform == "linux":
            if _madvise()(addr, size, MADV_POPULATE_WRITE) == 0:
                return True
            err = ctypes.get_errno()
            if err != errno.EINVAL:  # ENOMEM and the like: leave the rest to fault lazily
                log.warning("arena: cannot populate %d bytes (%s); receiving into lazily faulted memory",
                            size, errno.errorcode.get(err, err))
                return False
        ctypes.memset(addr, 0, size)  # older kernels: write every page (ctypes drops the GIL here too)
        return True
    finally:
        del anchor
