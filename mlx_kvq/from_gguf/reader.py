"""A GGUF file's metadata and tensor table, read in one pass.

gguf's own `GGUFReader` builds a numpy view per array element, which costs
minutes for a 262,144-token vocabulary on a small CPU; this reads the same
format (GGUF v2/v3, little-endian) with one `struct` call per string and one
`np.frombuffer` per numeric array, and maps the tensor data without copying.
Block sizes come from gguf (`GGML_QUANT_SIZES`), which also dequantizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_NUMPY = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: its name, GGML type name, shape in numpy order
    (outermost first) and its bytes, mapped from the file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 bytes for block types, the dtype itself for dense ones


class GGUFError(ValueError):
    """The file is not GGUF, or is cut short."""


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str, size: int) -> Any:
        if self.pos + size > len(self.buf):
            raise GGUFError("the file ends inside its metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q", 8)
        raw = bytes(self.buf[self.pos : self.pos + n])
        if len(raw) != n:
            raise GGUFError("the file ends inside a string")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I", 4), self.scalar("<Q", 8)
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFError("the file ends inside an array")
                out = np.frombuffer(self.buf[self.pos : end], dtype=dtype).tolist()
                self.pos = end
                return out
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise GGUFError(f"unknown metadata value type {kind}")
        return self.scalar(*_SCALARS[kind])


def read(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensors) of a GGUF file; GGUFError when it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mapped))
    if bytes(mapped[:4]) != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file")
    cur.pos = 4
    version = cur.scalar("<I", 4)
    if version not in (2, 3):
        raise GGUFError(f"GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q", 8), cur.scalar("<Q", 8)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        meta[key] = cur.value(cur.scalar("<I", 4))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.scalar("<Q", 8) for _ in range(cur.scalar("<I", 4))]
        kind, offset = cur.scalar("<I", 4), cur.scalar("<Q", 8)
        table.append((name, dims, kind, offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, kind, offset in table:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise GGUFError(f"tensor {name}: unknown GGML type {kind}") from None
        block, size = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))
        n_bytes = int(np.prod(dims)) // block * size
        begin = start + offset
        if begin + n_bytes > len(mapped):
            raise GGUFError(f"tensor {name}: the file is cut short")
        raw = mapped[begin : begin + n_bytes]
        if qtype.name in ("F32", "F16", "F64"):
            data = raw.view(np.dtype({"F32": "<f4", "F16": "<f2", "F64": "<f8"}[qtype.name]))
            data = data.reshape(shape)
        else:
            data = raw.reshape(shape[:-1] + (shape[-1] // block * size,)) if shape else raw
        tensors.append(TensorInfo(name, qtype.name, shape, data))
    return meta, tensors
