"""Decode-state migration: once a loading engine B holds the whole model, each sequence it still runs
split (its KV for layers k..L-1 on the pair A, A sampling its tokens) moves to B, so B decodes it alone
and A stops carrying it (BlitzScale's last ZigZag step).

Protocol (on the pair's step frames, cooperation.py): B parks the sequence (no step of it is out) and
names it in its next frame, `"migrate": [[req, k], ...]`; A, in its step thread (its cache is quiet
there), copies the sequence's K/V of layers k..L-1 for every position it holds and its sampling
generator's state, frees them, and answers `"migrated": [[req, k, n, error, generator state | null],
...]` with the K/V as the answer's payload (per sequence, layer-major: layer, K|V, position, head, dim;
little endian in the cache's dtype). B checks `n` against the positions it computed, writes the K/V
into its own pages for those layers, restores the generator (seeded sampling stays exact) and from
then on runs the sequence through every layer itself. An error (A does not hold it whole, e.g. a
pipeline hop) leaves the sequence split; it finishes on A as before.

Data flow: B `wanted` (which, within a byte budget) -> A `take` (cache -> bytes) -> B `put` (bytes ->
cache). Pure torch on the caches; the frames are cooperation.py's. `take_from` / `put_into` / `engine_kv_bytes`
do the same on an engine, whose KV a tensor-parallel engine holds split over its ranks (gathered at rank 0).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING

import torch

from kascade_engine.batch.kvcache import KVCache

if TYPE_CHECKING:
    from kascade_engine.batch.engine import Engine

MIGRATE_BYTES = 64 << 20  # K/V bytes moved per step answer at most (at least one sequence): bounds the frame


def _slots(cache: KVCache, table: list[int], n: int) -> torch.Tensor:
    ps = cache.page_size
    return torch.tensor([table[p // ps] * ps + p % ps for p in range(n)], dtype=torch.long, device=cache.device)


def kv_bytes(cache: KVCache, layers: int, n: int) -> int:
    """Bytes of `layers` layers of K and V for `n` positions."""
    return layers * n * cache.bytes_per_token // cache.layers


def take(cache: KVCache, table: list[int], k: int, n: int) -> bytes:
    """A: the K/V of layers k..L-1 for positions 0..n-1 of the sequence whose pages are `table`."""
    slots = _slots(cache, table, n)
    parts = [torch.stack((cache.k[layer].index_select(0, slots), cache.v[layer].index_select(0, slots)))
             for layer in range(k, cache.layers)]
    return torch.stack(parts).to("cpu").contiguous().view(torch.uint8).numpy().tobytes()


def put(cache: KVCache, table: list[int], k: int, n: int, payload: memoryview) -> None:
    """B: write what `take` produced into this engine's pages `table` (layers k..L-1, positions 0..n-1)."""
    want = kv_bytes(cache, cache.layers - k, n)
    if len(payload) != want:
        raise ValueError(f"migrated K/V has {len(payload)} bytes, {want} expected for layers {k}.. x {n} positions")
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(cache.dtype).view(
        cache.layers - k, 2, n, cache.kv_heads, cache.head_dim).to(cache.device)
    slots = _slots(cache, table, n)
    for i, layer in enumerate(range(k, cache.layers)):
        cache.write(layer, slots, kv[i, 0], kv[i, 1])


# -- an engine's sequence, whatever its tensor parallelism: a TP engine's KV heads are split over its ranks, so its
# K/V go through `read_kv` / `write_kv` (gathered at / scattered from rank 0: tp/kv.py); the bytes are the whole
# model's heads either way, so a TP-1 and a TP-g engine migrate to each other.
def engine_kv_bytes(engine: Engine, layers: int, n: int) -> int:
    """Bytes of `layers` layers of the whole model's K and V for `n` positions."""
    c = engine.cache
    return 2 * layers * n * engine.kv_heads * c.head_dim * c.k.element_size()


def take_from(engine: Engine, table: list[int], k: int, n: int) -> bytes:
    """`take` on `engine` (a TP engine gathers every rank's heads)."""
    if engine.tp == 1:
        return take(engine.cache, table, k, n)
    kk, vv = engine.read_kv(_slots(engine.cache, table, n))  # [layers, n, kv_heads, head_dim] each
    return torch.stack((kk[k:], vv[k:]), dim=1).contiguous().view(torch.uint8).numpy().tobytes()


def put_into(engine: Engine, table: list[int], k: int, n: int, payload: memoryview) -> None:
    """`put` on `engine` (a TP engine: its KV of layers 0..k-1 read back, layers k.. replaced, every rank's heads
    written)."""
    if engine.tp == 1:
        put(engine.cache, table, k, n, payload)
        return
    c, L = engine.cache, engine.cache.layers
    want = engine_kv_bytes(engine, L - k, n)
    if len(payload) != want:
        raise ValueError(f"migrated K/V has {len(payload)} bytes, {want} expected for layers {k}.. x {n} positions")
    kv = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(c.dtype).view(L - k, 2, n, engine.kv_heads,
                                                                                   c.head_dim)
    slots = _slots(c, table, n)
    kk, vv = engine.read_kv(slots)
    kk[k:], vv[k:] = kv[:, 0], kv[:, 1]
    engine.write_kv(slots, kk, vv)


def gen_state(gen: torch.Generator | None) -> str | None:
    return base64.b64encode(gen.get_state().numpy().tobytes()).decode() if gen is not None else None


def set_gen_state(gen: torch.Generator | None, state: object) -> None:
    """Continue A's draws on B's generator (same seed, so the same kind): seeded sampling stays exact."""
    if gen is None or state is None:
        return
    if not isinstance(state, str):
        raise ValueError(f"generator state must be a base64 string, got {type(state).__name__}")
    gen.set_state(torch.frombuffer(bytearray(base64.b64decode(state, validate=True)), dtype=torch.uint8))
