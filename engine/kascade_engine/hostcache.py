"""Host-cache file: a whole BlockSet in one memory-mappable file.

Layout: b"KASCADE1" | u64 header length | JSON header {model, config, blocks: [{id, offset, bytes,
digest, index}]} | block data, each block 4 KiB aligned. `open_cache` maps the file and hands out
blocks as zero-copy views; digests are checked on demand (`verify=True` checks all at open).
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

from kascade_engine.blocks import Block, BlockSet, CheckpointError, index_from_manifest

MAGIC = b"KASCADE1"
PAGE = 4096


def write_cache(path: Path | str, blocks: BlockSet) -> None:
    manifest = blocks.manifest()
    entries, offset = [], 0
    for bid, entry in manifest.items():
        offset = (offset + PAGE - 1) // PAGE * PAGE
        entries.append({"id": bid, "offset": offset, **entry})
        offset += entry["bytes"]
    header = json.dumps({"model": blocks.model, "config": blocks.config, "blocks": entries}).encode()
    data_start = (len(MAGIC) + 8 + len(header) + PAGE - 1) // PAGE * PAGE
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header)
        for e in entries:
            f.seek(data_start + e["offset"])
            f.write(blocks.blocks[e["id"]].data)
        f.truncate(data_start + offset)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)  # atomic: a reader never sees a half-written cache


def open_cache(path: Path | str, verify: bool = False) -> BlockSet:
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if head[: len(MAGIC)] != MAGIC:
            raise CheckpointError(f"{p}: not a Kascade host-cache file (bad magic)")
        n = int.from_bytes(head[len(MAGIC):], "little")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{p}: corrupt header ({e})") from None
        data_start = (len(MAGIC) + 8 + n + PAGE - 1) // PAGE * PAGE
        size = os.fstat(f.fileno()).st_size
        # Copy-on-write: writable views (torch.frombuffer needs them) that never modify the file.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    blocks = []
    for entry in header["blocks"]:
        begin = data_start + int(entry["offset"])
        if mm is None or begin + int(entry["bytes"]) > size:
            raise CheckpointError(f"{p}: block {entry['id']!r} extends past the end of the file (truncated?)")
        block = Block(entry["id"], memoryview(mm)[begin:begin + int(entry["bytes"])], index_from_manifest(entry),
                      entry["digest"])
        if verify and not block.verify():
            raise CheckpointError(f"{p}: block {entry['id']!r} fails its digest")
        blocks.append(block)
    return BlockSet(header["model"], header.get("config", {}), blocks)
