"""An engine's use of its node's cache (ADR 16, nodecache.py): its weights come from the node's one copy of its
model, so N replicas on a node hold one host copy, not N.

With `--node-cache-dir` (a memory-backed directory shared by the node's engine pods) an engine never keeps a
private host copy of a model the node cache holds:
- loading from a source (a checkpoint directory, or a model URI once resolved): the node's copy is mapped
  instead (`find`: its blocks verified against their digests, and refused naming the mismatch when it is not
  this model: another model's name, another architecture, or another dtype than the source's tensors); when the
  node has none (or a damaged or refused one, removed when no engine maps it), the engine packs the source,
  publishes the blocks as the node's copy and maps that (`share`), dropping its packed private bytes;
- loading by plan: the blocks that landed are published (or the node's copy, when another engine published the
  same blocks first, is mapped) once the transfer is over, and the model's weights become views of the copy;
- CPU: the model's weights are torch views of the mapping (zero-copy, the same pages in every engine); CUDA: the
  device weights are uploaded from the mapping and the host blocks the engine keeps (its chain-source buffers)
  are the mapping itself, not a private pinned mirror.
The engine holds one `Lease` (a shared flock: the copy is not evicted while mapped) for as long as it serves from
the copy or keeps it as its host copy (`drop` when it does neither).

Data flow: (model, config, the source's tensor dtypes) -> `find` -> the node's `BlockSet` or None; a private
`BlockSet` -> `share` -> the node's `BlockSet` (or the private one when the node's budget cannot hold it, saying
why). `load_checkpoint` is both for a checkpoint directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kascade_engine.batch.families import FamilyError, expected_shapes
from kascade_engine.weights.blocks import BlockSet, CheckpointError, pack_checkpoint, tensor_dtypes
from kascade_engine.weights.nodecache import Lease, NodeCache

log = logging.getLogger(__name__)
_TORCH_DTYPE = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


def mismatch(copy: BlockSet, model: str, cfg: Mapping[str, Any], dtypes: Mapping[str, str] | None) -> str | None:
    """Why the node's `copy` is not `model` as the engine knows it (None: it is): the model name, a tensor's shape
    under the engine's config (the architecture), or a tensor's dtype against the source's (`dtypes`; with none
    known, the config's torch_dtype when it names one)."""
    if copy.model != model:
        return f"model: the node's copy is of {copy.model!r}, this engine serves {model!r}"
    try:
        want = expected_shapes(cfg)
    except (FamilyError, ValueError, TypeError) as e:
        return f"config: {e}"
    metas = {m.name: m for b in copy.blocks.values() for m in b.index}
    for name, shape in want.items():
        m = metas.get(name)
        if m is None:
            return f"tensor {name!r}: missing from the node's copy"
        if m.shape != tuple(shape):
            return f"shape: tensor {name!r} is {list(m.shape)} in the node's copy, {list(shape)} for this model"
        expect = dtypes.get(name) if dtypes is not None else _TORCH_DTYPE.get(str(cfg.get("torch_dtype")))
        if expect is not None and m.dtype != expect:
            return f"dtype: tensor {name!r} is {m.dtype} in the node's copy, {expect} in the source"
    return None


def trim() -> None:
    """Give freed heap pages back to the system (glibc keeps large freed buffers otherwise): the private packed
    or received blocks an engine drops for the node's copy must leave its resident memory."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):  # another libc: its own policy
            ctypes.CDLL("libc.so.6").malloc_trim(0)


class NodeCopies:
    """An engine's handle on its node cache: which copy it maps (at most one lease)."""

    def __init__(self, cache: NodeCache) -> None:
        self.cache = cache
        self.lease: Lease | None = None

    @property
    def path(self) -> str | None:
        return str(self.lease.path) if self.lease is not None else None

    def find(self, model: str, cfg: Mapping[str, Any], dtypes: Mapping[str, str] | None) -> BlockSet | None:
        """The node's verified copy of `model`, mapped and held; None (saying why when there is one) otherwise."""
        where = self.cache.path(model)
        try:
            lease = self.cache.attach(model, verify=True)
        except (CheckpointError, OSError) as e:
            gone = self.cache.discard(model)
            log.warning("node cache: the copy of %s at %s is damaged (%s): not used%s; loading from the source",
                        model, where, e, ", removed" if gone else " (still mapped by another engine)")
            return None
        if lease is None:
            return None
        why = mismatch(lease.blocks, model, cfg, dtypes)
        if why is not None:
            lease.close()
            gone = self.cache.discard(model)
            log.warning("node cache: the copy at %s is refused: %s%s; loading from the source", where, why,
                        " (removed)" if gone else " (still mapped by another engine)")
            return None
        self._hold(lease)
        log.info("node cache: mapped the node's copy of %s (%s, %.1f MB): no private host copy", model, where,
                 lease.blocks.total_bytes / 1e6)
        return lease.blocks

    def share(self, blocks: BlockSet) -> BlockSet:
        """The node's copy of `blocks` (published from them when the node has none), mapped and held; `blocks`
        themselves when the node cannot hold it or holds other bytes under the name (logged)."""
        try:
            ok, why = self.cache.publish(blocks)
            # verified: the copy may be another engine's (even a damaged one still mapped there, so not removed)
            lease = self.cache.attach(blocks.model, verify=True) if ok else None
        except (OSError, CheckpointError) as e:  # not writable by this engine's user, the tmpfs full, ...
            ok, why, lease = False, f"{type(e).__name__}: {e}", None
        if lease is None:
            log.info("node cache: keeping a private host copy of %s: %s", blocks.model, why or "evicted meanwhile")
            return blocks
        if lease.blocks.manifest() != blocks.manifest():
            lease.close()
            log.warning("node cache: the node's copy of %s at %s holds other blocks than this engine's (other "
                        "digests): keeping a private host copy", blocks.model, self.cache.path(blocks.model))
            return blocks
        self._hold(lease)
        log.info("node cache: %s is the node's copy at %s (%.1f MB), mapped", blocks.model, lease.path,
                 blocks.total_bytes / 1e6)
        return lease.blocks

    def _hold(self, lease: Lease) -> None:
        if self.lease is not None and self.lease is not lease:
            self.lease.close()
        self.lease = lease

    def drop(self) -> None:
        """The engine neither serves from the copy nor keeps it: the node may evict it."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None


def node_copies(config: Any) -> NodeCopies | None:
    """The engine's node cache from its EngineConfig (`node_cache_dir`, `node_cache_bytes`); None without one."""
    if config.node_cache_dir is None:
        return None
    try:
        cache = NodeCache(config.node_cache_dir, config.node_cache_bytes)
        cache.clean()  # a crashed writer's leftovers (a previous engine of this node)
    except OSError as e:
        log.error("--node-cache-dir %s is not usable (%s): this engine keeps private host copies",
                  config.node_cache_dir, e)
        return None
    return NodeCopies(cache)


def load_checkpoint(node: NodeCopies | None, d: Path, model: str) -> BlockSet:
    """The blocks of the checkpoint at `d`: the node's copy when it has a valid one, else packed from `d` (and,
    with a node cache, published as the node's copy and mapped, the packed bytes dropped)."""
    if node is None:
        return pack_checkpoint(d, model)
    try:
        cfg = json.loads((d / "config.json").read_text())
        dtypes: Mapping[str, str] | None = tensor_dtypes(d)
    except (OSError, ValueError, CheckpointError):
        cfg, dtypes = None, None  # pack_checkpoint below names what is wrong
    if isinstance(cfg, dict):
        found = node.find(model, cfg, dtypes)
        if found is not None:
            return found
    packed = pack_checkpoint(d, model)
    shared = node.share(packed)
    if shared is not packed:
        del packed
        trim()
    return shared
