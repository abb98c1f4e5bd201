"""The node cache (kascade_engine.weights.nodecache): one copy per model per node, mapped by every engine,
kept while any maps it, evicted by demand under the budget; a crashed engine's lock goes with it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from kascade_engine.weights.blocks import Block, BlockSet, digest_of
from kascade_engine.weights.nodecache import NodeCache

MB = 1 << 20


def blockset(model: str, blocks: int = 3, size: int = 64 * 1024) -> BlockSet:
    out = []
    for i in range(blocks):
        data = bytes([(i * 7 + len(model)) % 251]) * size
        out.append(Block(f"layer.{i}", memoryview(data), (), digest_of(data)))
    return BlockSet(model, {"family": "test"}, out)


def test_published_copy_is_mapped_by_another_engine_and_verifies(tmp_path: Path) -> None:
    a, b = NodeCache(tmp_path, 8 * MB), NodeCache(tmp_path, 8 * MB)
    assert b.attach("org/m") is None
    assert a.publish(blockset("org/m")) == (True, "")
    assert a.publish(blockset("org/m")) == (True, "")  # already there: nothing written twice
    got = b.attach("org/m", verify=True)
    assert got is not None
    with got as lease:
        assert lease.blocks.model == "org/m" and bytes(lease.blocks.blocks["layer.1"].data) == bytes([12]) * 65536
        # copy-on-write: a write through one mapping never reaches the file others map
        lease.blocks.blocks["layer.0"].data[0] = 99
        with NodeCache(tmp_path, 8 * MB).attach("org/m") as other:  # type: ignore[union-attr]
            assert bytes(other.blocks.blocks["layer.0"].data[:2]) == bytes([5, 5])
    assert len(list(tmp_path.glob("*.kcache"))) == 1


def test_a_copy_in_use_is_never_evicted_unused_ones_go_least_recent_first(tmp_path: Path) -> None:
    size = 3 * 64 * 1024 + 64 * 1024
    cache = NodeCache(tmp_path, 2 * size + 1)
    assert cache.publish(blockset("a"))[0] and cache.publish(blockset("b"))[0]
    lease = cache.attach("a")
    assert lease is not None
    cache.attach("b").close()  # type: ignore[union-attr]  # b attached later than a, but a is in use
    ok, _ = cache.publish(blockset("c"))
    assert ok and {e.model_file for e in cache.entries()} == {"a.kcache", "c.kcache"}
    # d does not fit beside a (in use) and c would have to go: c goes, a stays
    assert cache.publish(blockset("d"))[0]
    assert {e.model_file for e in cache.entries()} == {"a.kcache", "d.kcache"}
    lease.close()


def test_budget_refusal_says_why(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 100 * 1024)
    ok, why = cache.publish(blockset("big"))
    assert not ok and "budget" in why and "big" in why
    assert cache.entries() == []


def test_a_crashed_engines_lock_goes_with_it(tmp_path: Path) -> None:
    cache = NodeCache(tmp_path, 8 * MB)
    cache.publish(blockset("m"))
    code = textwrap.dedent(f"""
        import sys
        from kascade_engine.weights.nodecache import NodeCache
        lease = NodeCache({str(tmp_path)!r}, 8 << 20).attach("m")
        print("attached", flush=True)
        sys.stdin.read()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "attached"
        assert [e.in_use for e in cache.entries()] == [True]
        assert cache.evict(8 * MB) == []  # in use by the child
    finally:
        child.kill()
        child.wait()
    assert [e.in_use for e in cache.entries()] == [False]
    assert cache.evict(8 * MB) == ["m.kcache"]


def test_bad_input_names_the_field(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(ValueError, match="budget_bytes"):
        NodeCache(tmp_path, -1)
    with pytest.raises(ValueError, match="model"):
        NodeCache(tmp_path, 1).path("")
