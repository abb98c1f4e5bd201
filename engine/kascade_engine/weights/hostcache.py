"""Host-cache file: a whole BlockSet in one memory-mappable file.

Layout: b"KASCADE1" | u64 header length | JSON header {model, config, blocks: [{id, offset, bytes,
digest, index}]} | block data, each block 4 KiB aligned. `open_cache` maps the file and hands out
blocks as zero-copy views; digests are checked on demand (`verify=True` checks all at open).

Completion: the writer writes everything under a temporary name with zeros where the magic goes, syncs,
then writes the magic (the completion marker), syncs again and renames the file into place. A reader
never sees a half-written file under the final name, and a half-written one copied or left elsewhere has
no magic: `open_cache` refuses it as incomplete. The block digests are the checksum of the data.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

from kascade_engine.weights.blocks import Block, BlockSet, CheckpointError, index_from_manifest

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
        f.write(bytes(len(MAGIC)) + len(header).to_bytes(8, "little") + header)
        for e in entries:
            f.seek(data_start + e["offset"])
            f.write(blocks.blocks[e["id"]].data)
        f.truncate(data_start + offset)
        f.flush()
        os.fsync(f.fileno())
        f.seek(0)
        f.write(MAGIC)  # the completion marker, written last
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)  # atomic: a reader never sees a half-written cache


def open_cache(path: Path | str, verify: bool = False) -> BlockSet:
    p = Path(path)
    with open(p, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if head[: len(MAGIC)] == bytes(len(MAGIC)):
            raise CheckpointError(f"{p}: incomplete host-cache file (no completion marker: its writer never "
                                  "finished)")
        if head[: len(MAGIC)] != MAGIC:
            raise CheckpointError(f"{p}: not a Kascade host-cache file (bad magic)")
        n = int.from_bytes(head[len(MAGIC):], "little")
        size = os.fstat(f.fileno()).st_size
        if n > size:  # a damaged length must not become a huge read
            raise CheckpointError(f"{p}: corrupt header (announces {n} bytes, the file has {size})")
        try:
            header = json.loads(f.read(n))
            if not isinstance(header, dict) or not isinstance(header.get("blocks"), list):
                raise ValueError("expected an object with a 'blocks' list")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{p}: corrupt header ({e})") from None
        data_start = (len(MAGIC) + 8 + n + PAGE - 1) // PAGE * PAGE
        # Copy-on-write: writable views (torch.frombuffer needs them) that never modify the file.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    blocks = []
    for i, entry in enumerate(header["blocks"]):
        try:
            begin, nbytes = data_start + int(entry["offset"]), int(entry["bytes"])
            if begin < data_start or nbytes < 0:
                raise ValueError(f"offset {entry['offset']} / bytes {nbytes} out of range")
            if mm is None or begin + nbytes > size:
                raise CheckpointError(f"{p}: block {entry['id']!r} extends past the end of the file (truncated?)")
            block = Block(str(entry["id"]), memoryview(mm)[begin:begin + nbytes], index_from_manifest(entry),
                          str(entry["digest"]))
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{p}: block entry {i} is damaged ({type(e).__name__}: {e})") from None
        if verify and not block.verify():
            raise CheckpointError(f"{p}: block {entry['id']!r} fails its digest")
        blocks.append(block)
    return BlockSet(str(header.get("model", "")), header.get("config", {}), blocks)
