"""A safetensors file, read safely: the header is validated against the file before any tensor byte
is touched, and tensor bytes are read through a memory map (nothing is loaded whole).

Format: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__"?}, then the data area; offsets are relative to the data area.
Checked here, each failure naming the file and the tensor: n fits the file; the header is a JSON object;
dtype is known; shape is a list of non-negative ints; 0 <= begin <= end; end - begin equals
prod(shape) x itemsize; the data area holds end (a truncated file fails here, before any digest).

Data flow: `read_header(path)` -> {name: TensorEntry}; `TensorFile(path)` maps the file once and
`view(entry)` gives a zero-copy memoryview of that tensor's bytes (the page cache backs it).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER = 100 << 20  # the format's own limit


class TensorFileError(ValueError):
    """A safetensors file that is malformed, truncated or inconsistent; the message names file and tensor."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(path: Path) -> dict[str, TensorEntry]:
    try:  # a symlink loop, a dangling link, a directory named *.safetensors: an error naming it, no traceback
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise TensorFileError(f"{path.name}: not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n > min(MAX_HEADER, size - 8):
                raise TensorFileError(f"{path.name}: not a safetensors file (header length {n} exceeds the file's "
                                      f"{size - 8} bytes)")
            raw = f.read(n)
    except OSError as e:
        raise TensorFileError(f"{path.name}: cannot be read ({e.strerror or e})") from None
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise TensorFileError(f"{path.name}: not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(doc, dict):
        raise TensorFileError(f"{path.name}: not a safetensors file (header is not a JSON object)")
    base, data = 8 + n, size - 8 - n
    out: dict[str, TensorEntry] = {}
    for name, meta in doc.items():
        if name == "__metadata__":
            continue
        where = f"{path.name}: tensor {name!r}"
        if not isinstance(meta, dict):
            raise TensorFileError(f"{where}: header entry is not an object")
        dtype, shape, offs = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
        if dtype not in ITEMSIZE:
            raise TensorFileError(f"{where} has unsupported dtype {dtype}")
        if not isinstance(shape, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in shape):
            raise TensorFileError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offs, list) or len(offs) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise TensorFileError(f"{where}: data_offsets {offs!r} must be [begin, end] with 0 <= begin <= end")
        want = ITEMSIZE[dtype]
        for x in shape:
            want *= x
        if offs[1] - offs[0] != want:
            raise TensorFileError(f"{where}: data_offsets {offs} hold {offs[1] - offs[0]} bytes, shape {shape} "
                                  f"{dtype} needs {want}")
        if offs[1] > data:
            raise TensorFileError(f"{where}: data ends at byte {offs[1]} of the data area, the file holds only "
                                  f"{data} (truncated?)")
        out[name] = TensorEntry(path, name, dtype, tuple(shape), base + offs[0], base + offs[1])
    return out


class TensorFile:
    """One memory map of a safetensors file (read-only, shared with the page cache)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def view(self, e: TensorEntry) -> memoryview:
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)[e.begin:e.end]

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a view is still alive somewhere; the map goes with it
                self._map.close()
