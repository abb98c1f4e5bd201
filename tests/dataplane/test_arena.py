"""The receive arena: regions reserved ahead of the stream, handed out once per block, writable, and
never aliased between the populating thread and the receiver."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kascade_engine.weights.arena import ReceiveArena, _populate


def _resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_regions_are_reserved_ahead_in_order_and_faulted_in() -> None:
    sizes = [("embed", 3 << 20), ("layer.0", 5 << 20), ("head", 1 << 20)]
    arena = ReceiveArena(sizes)
    before = _resident_kib()
    arena.start()
    assert arena._thread is not None
    arena._thread.join(timeout=30)
    assert arena.populated == 3
    assert _resident_kib() - before >= (9 << 20) // 1024 * 9 // 10  # the pages exist before any byte lands
    views = {b: arena.take(b, n) for b, n in sizes}
    assert {b: len(v) for b, v in views.items()} == dict(sizes)
    assert arena.take("layer.0", 5 << 20).obj is views["layer.0"].obj  # one region per block
    views["layer.0"][:4] = b"abcd"
    assert bytes(arena.take("layer.0", 5 << 20)[:4]) == b"abcd"
    assert bytes(views["embed"][:16]) == bytes(16)  # populated, not written


def test_a_block_taken_before_the_thread_reaches_it_is_never_replaced() -> None:
    arena = ReceiveArena([("a", 1 << 20), ("b", 1 << 20)])
    early = arena.take("b", 1 << 20)  # the stream got to "b" first
    early[0] = 7
    arena.start()
    assert arena._thread is not None
    arena._thread.join(timeout=30)
    assert arena.populated == 1  # only "a"; "b" faults lazily where the receiver already writes
    assert arena.take("b", 1 << 20)[0] == 7


def test_views_outlive_close_and_torch_views_them_without_copying() -> None:
    arena = ReceiveArena([("a", 4096)])
    arena.start()
    view = arena.take("a", 4096)
    arena.close()
    view[:4] = bytes([1, 2, 3, 4])
    t = torch.frombuffer(view, dtype=torch.uint8)
    t[4] = 9
    assert view[4] == 9 and t[:4].tolist() == [1, 2, 3, 4]


def test_a_size_other_than_the_reserved_one_is_refused_naming_the_block() -> None:
    arena = ReceiveArena([("layer.3", 8192)])
    arena.take("layer.3", 8192)
    with pytest.raises(ValueError, match=r"layer\.3"):
        arena.take("layer.3", 4096)


def test_populating_leaves_the_interpreter_free() -> None:
    """The whole point of populating in a thread: the event loop keeps running meanwhile."""
    arena = ReceiveArena([("big", 256 << 20)])
    region = arena.take("big", 256 << 20).obj
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.0005)

    ticker = threading.Thread(target=tick)
    ticker.start()
    t0 = time.monotonic()
    assert _populate(region)  # type: ignore[arg-type]
    elapsed = time.monotonic() - t0
    done.set()
    ticker.join()
    # Holding the GIL would allow ~1 tick; a free interpreter ticks about once per millisecond.
    assert ticks >= max(3, int(elapsed * 1000 * 0.2)), (ticks, elapsed)
