"""A GGUF file's header: its metadata as Python values and where each tensor's bytes lie.

NOTE: `gguf.GGUFReader` builds a numpy view for every part of every field: for SmolLM2's 49,152
vocabulary strings and 48,900 merges that took 4-6 s of every engine's and every gateway's
start-up here. This reads the same header with `struct` in ~0.1 s. `gguf` (the package) stays the
reference for the values (tests compare the two) and does the dequantizing.

Layout (little-endian, GGUF v2/v3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count, the metadata (key string, u32 value type, value), the tensor infos (name, u32 n_dims,
u64 dims fastest-first, u32 ggml type, u64 offset), padding to `general.alignment` (32), data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format of one scalar (8 string, 9 array are read apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not GGUF, or not one this reader understands; the message says which."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGML order: the fastest-varying axis first
    ggml_type: int  # a gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, data: mmap.mmap, path: str) -> None:
        self.data = data
        self.path = path
        self.pos = 0

    def error(self, reason: str) -> GGUFError:
        return GGUFError(f"{self.path} is not a readable GGUF file: {reason}")

    def take(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        except struct.error:
            raise self.error("it ends inside its header") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        raw = self.data[self.pos : self.pos + n]
        if len(raw) != n:
            raise self.error("it ends inside its header")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            inner, count = self.take("I"), self.take("Q")
            if inner in _SCALARS:  # one unpack for the whole array
                fmt = f"<{count}{_SCALARS[inner]}"
                try:
                    items = list(struct.unpack_from(fmt, self.data, self.pos))
                except struct.error:
                    raise self.error("it ends inside its header") from None
                self.pos += struct.calcsize(fmt)
                return items
            return [self.value(inner) for _ in range(count)]
        if kind not in _SCALARS:
            raise self.error(f"unknown value type {kind} in its metadata")
        return self.take(_SCALARS[kind])


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """The metadata and tensor infos of a GGUF file, reading only its header. Raises GGUFError."""
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != MAGIC:
            raise GGUFError(f"{path} is not a readable GGUF file: it does not start with 'GGUF'")
        version, n_tensors, n_meta = struct.unpack_from("<IQQ", head, 4)
        if version not in VERSIONS:
            raise GGUFError(f"{path} is not a readable GGUF file: it is version {version}, kvharbor reads 2 and 3")
        # Mapped, not read: only the header's pages are touched, however large the weights are.
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(str(path), data, version, n_tensors, n_meta)


def _parse(path: str, data: mmap.mmap, version: int, n_tensors: int, n_meta: int) -> GGUFHeader:
    cur = _Cursor(data, path)
    cur.pos = 24
    metadata = {}
    for _ in range(n_meta):
        key = cur.string()
        metadata[key] = cur.value(cur.take("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.take("Q") for _ in range(cur.take("I")))
        infos.append((name, dims, cur.take("I"), cur.take("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.error(f"general.alignment is {alignment!r}, not a power of two")
    start = -(-cur.pos // alignment) * alignment
    tensors = [TensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in infos]
    return GGUFHeader(version, metadata, tensors)
