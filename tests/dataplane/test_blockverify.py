"""Incremental block verification: chunks hashed as they land (in order or not) give the whole block's
digest, and a corrupt, shifted or duplicated chunk still fails it."""

from __future__ import annotations

import os
import random

import pytest
import xxhash

from kascade_engine.weights.blocks import digest_of, new_hasher
from kascade_engine.weights.blockverify import BlockVerifier

SIZE = 1_000_003  # not a multiple of the chunk: the last chunk is short
CHUNK = 65_536


def chunks(size: int = SIZE, chunk: int = CHUNK) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)]


def land(src: bytes, digest: str, order: list[tuple[int, int]],
         tamper: dict[int, bytes] | None = None) -> tuple[memoryview, BlockVerifier, int]:
    """Land `order`'s chunks of `src` into a fresh buffer as a relay would (copy in, then `landed`),
    running each returned job at once; `tamper` replaces the bytes of the chunk at that offset. Returns
    the buffer, the verifier (not sealed) and how many chunks gave a job."""
    buf = memoryview(bytearray(len(src)))
    v = BlockVerifier(buf, digest)
    jobs = 0
    for off, n in order:
        buf[off:off + n] = (tamper or {}).get(off, src[off:off + n])
        job = v.landed(off, n)
        if job is not None:
            job()
            jobs += 1
    return buf, v, jobs


def receive(src: bytes, digest: str, order: list[tuple[int, int]],
            tamper: dict[int, bytes] | None = None) -> tuple[bool, BlockVerifier]:
    """`land`, then the commit check's answer."""
    _, v, _ = land(src, digest, order, tamper)
    return v.seal()(), v


@pytest.fixture(scope="module")
def src() -> bytes:
    return os.urandom(SIZE)


def test_streaming_hashers_equal_the_one_shot_digests(src: bytes) -> None:
    for algo in ("xxh3-128", "sha256"):
        h = new_hasher(algo)
        assert h is not None
        for off, n in chunks():
            h.update(src[off:off + n])
        assert digest_of(src, algo).endswith(h.hexdigest()), algo
    assert xxhash.xxh3_128(src).hexdigest() == xxhash.xxh3_128_hexdigest(src)
    assert new_hasher("md5") is None


def test_in_order_chunks_are_hashed_as_they_land(src: bytes) -> None:
    buf = memoryview(bytearray(SIZE))
    v = BlockVerifier(buf, digest_of(src))
    for off, n in chunks():
        buf[off:off + n] = src[off:off + n]
        job = v.landed(off, n)
        assert job is not None and v.scheduled == off + n  # each chunk hashed right after it landed
        job()
    assert v.streaming and v.seal()()


def test_out_of_order_chunks_wait_for_the_gap_then_match(src: bytes) -> None:
    order = chunks()
    order[1], order[4] = order[4], order[1]  # chunk 4 arrives early: nothing past the gap is hashed
    ok, v = receive(src, digest_of(src), order)
    assert ok and v.streaming
    shuffled = chunks()
    random.Random(7).shuffle(shuffled)
    assert receive(src, digest_of(src), shuffled)[0]


def test_gap_is_not_hashed_before_it_fills(src: bytes) -> None:
    buf = memoryview(bytearray(SIZE))
    v = BlockVerifier(buf, digest_of(src))
    assert v.landed(CHUNK, CHUNK) is None  # beyond the gap at 0
    assert v.scheduled == 0
    buf[:CHUNK] = src[:CHUNK]
    job = v.landed(0, CHUNK)
    assert job is not None and v.scheduled == 2 * CHUNK  # the early chunk joins the prefix


def test_shards_from_two_upstreams_interleaved(src: bytes) -> None:
    half = SIZE // 2
    a = [(off, min(CHUNK, half - off)) for off in range(0, half, CHUNK)]
    b = [(off, min(CHUNK, SIZE - off)) for off in range(half, SIZE, CHUNK)]
    order = [c for pair in zip(b, a, strict=False) for c in pair] + a[len(b):] + b[len(a):]
    assert sorted(order) == sorted(a + b)
    assert receive(src, digest_of(src), order)[0]


def test_missing_chunk_is_hashed_at_the_seal_and_fails(src: bytes) -> None:
    order = chunks()
    del order[3]  # a commit without every chunk: the hole keeps whatever the buffer held
    ok, _ = receive(src, digest_of(src), order)
    assert not ok


@pytest.mark.parametrize("algo", ["xxh3-128", "sha256"])
def test_corrupt_chunk_fails_in_order_and_out_of_order(src: bytes, algo: str) -> None:
    off, n = chunks()[5]
    bad = bytes([src[off] ^ 0xFF]) + src[off + 1:off + n]
    assert receive(src, digest_of(src, algo), chunks())[0]
    assert not receive(src, digest_of(src, algo), chunks(), tamper={off: bad})[0]
    assert not receive(src, digest_of(src, algo), list(reversed(chunks())), tamper={off: bad})[0]


def test_shifted_chunk_overlaps_and_the_whole_buffer_decides(src: bytes) -> None:
    """A desynced source sends a chunk 16 bytes before its place: it overwrites hashed bytes."""
    order = chunks()
    off, n = order[3]
    order[3] = (off - 16, n)
    buf = memoryview(bytearray(SIZE))
    v = BlockVerifier(buf, digest_of(src))
    for o, m in order:
        buf[o:o + m] = src[off:off + n] if o == off - 16 else src[o:o + m]
        job = v.landed(o, m)
        if job is not None:
            job()
    assert v.overlapped and not v.streaming
    assert not v.seal()()


def test_duplicate_of_the_right_bytes_still_matches(src: bytes) -> None:
    """A re-fetch over a partial block rewrites landed bytes with the same ones: the full re-hash passes."""
    order = chunks()[:6] + chunks()
    ok, v = receive(src, digest_of(src), order)
    assert ok and v.overlapped


def test_overwrite_of_hashed_bytes_with_other_bytes_fails(src: bytes) -> None:
    """The running hash saw the right bytes; the buffer no longer holds them: the check must fail."""
    off, n = chunks()[2]
    buf, v, jobs = land(src, digest_of(src), chunks())
    assert jobs == len(chunks())  # every in-order chunk was hashed as it landed
    buf[off:off + n] = bytes(n)
    assert v.landed(off, n) is None
    assert not v.seal()()


def test_chunk_landing_after_the_seal_makes_the_check_rehash(src: bytes) -> None:
    buf, v, jobs = land(src, digest_of(src), chunks())
    assert jobs == len(chunks())  # every in-order chunk was hashed as it landed
    check = v.seal()
    buf[:CHUNK] = bytes(CHUNK)
    assert v.landed(0, CHUNK) is None
    assert not check()


def test_sha256_and_unknown_algorithms(src: bytes) -> None:
    assert receive(src, digest_of(src, "sha256"), list(reversed(chunks())))[0]
    ok, v = receive(src, "md5:" + "0" * 32, chunks())
    assert not ok and not v.streaming  # no streaming hasher: the whole-buffer check, which never matches


def test_hashing_failure_is_raised_by_the_check(src: bytes) -> None:
    buf = memoryview(bytearray(SIZE))
    v = BlockVerifier(buf, digest_of(src))
    job = v.landed(0, CHUNK)
    assert job is not None
    buf.release()  # the job can no longer read the buffer
    job()
    with pytest.raises(ValueError):
        v.seal()()


@pytest.mark.parametrize(("offset", "length"), [(-1, 10), (SIZE - 5, 10), (0, -1)])
def test_bad_ranges_are_refused(offset: int, length: int) -> None:
    v = BlockVerifier(memoryview(bytearray(SIZE)), digest_of(b""))
    with pytest.raises(ValueError, match="offset"):
        v.landed(offset, length)


def test_empty_block_matches(src: bytes) -> None:
    v = BlockVerifier(memoryview(bytearray(0)), digest_of(b""))
    assert v.landed(0, 0) is None
    assert v.seal()()


def test_given_up_running_hash_falls_back_to_the_whole_buffer(src: bytes) -> None:
    """A job that never ran (dropped by its runner) must not leave a hole in the hash."""
    buf = memoryview(bytearray(SIZE))
    v = BlockVerifier(buf, digest_of(src))
    for o, m in chunks():
        buf[o:o + m] = src[o:o + m]
        job = v.landed(o, m)
        if o == CHUNK:  # the second chunk's job is dropped
            v.give_up()
        elif job is not None:
            job()
    assert not v.streaming and v.seal()()
