"""The disk tier's file format: one validated record per file, written atomically.

A record is `MAGIC`, the header's length and CRC-32, the header (JSON: the
format version, the fingerprint of the model and KV setting it belongs to,
what it holds, and a table of its tensors with the CRC-32 of their bytes),
then the tensors' bytes. `read_record` refuses a file whose magic, lengths,
checksums, format or fingerprint do not match (`RecordError`, with a
`Skip` reason): a truncated, corrupted or foreign file is never used.

`write_record` writes a temporary file next to the final one (a name of
its own per process and thread, so several writers never share one),
fsyncs it and renames it into place: a reader sees the whole file or
none. A writer stopped halfway leaves only a temporary file, which no
reader opens (`is_temporary`) and the next start removes.
"""

from __future__ import annotations

import json
import math
import os
import socket
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

FORMAT = 1  # bump when what a record holds or how it is laid out changes
MAGIC = b"KVQDISK\x01"
_PREFIX = struct.Struct("<8sII")  # magic, header length, header CRC-32
_ALIGN = 16
MAX_HEADER = 64 << 20  # a longer header is a corrupted length
TEMP_MARK = ".tmp-"

# dtypes a record may hold, by name (never looked up on `mx`); bfloat16 is
# stored as its 16-bit pattern (numpy has no bfloat16)
_MX_DTYPES = {
    "bool": mx.bool_, "uint8": mx.uint8, "uint16": mx.uint16, "uint32": mx.uint32,
    "uint64": mx.uint64, "int8": mx.int8, "int16": mx.int16, "int32": mx.int32,
    "int64": mx.int64, "float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32,
}  # fmt: skip
_NP_DTYPES = {name: np.dtype("uint16" if name == "bfloat16" else name) for name in _MX_DTYPES}


class Skip(str, Enum):
    """Why the disk tier did not use or write something."""

    FOREIGN = "foreign"  # another model, KV setting or format version
    CORRUPT = "corrupt"  # truncated, checksum or structure wrong
    MISSING = "missing"  # gone (evicted, by this server or another one)
    NO_ROOM = "no_room"  # the prompt cache has no room for it in memory
    QUEUE_FULL = "queue_full"  # the writer's queue was full: not written
    TOO_LARGE = "too_large"  # bigger than the directory's cap
    WRITE_ERROR = "write_error"  # the filesystem refused the write (full disk, ...)
    UNSUPPORTED = "unsupported"  # a cache this tier cannot write


class RecordError(Exception):
    """A file that is not a record this server may use."""

    def __init__(self, reason: Skip, message: str):
        super().__init__(message)
        self.reason = reason


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def host_array(a: mx.array) -> np.ndarray:
    """An evaluated MLX array's bytes as numpy, C-contiguous (no copy when it
    is already; bfloat16 as uint16)."""
    name = dtype_name(a.dtype)
    if a.size == 0:
        return np.zeros(a.shape, _NP_DTYPES[name])
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.asarray(memoryview(a)))


def device_array(a: np.ndarray, name: str) -> mx.array:
    """A record's tensor as an MLX array of dtype `name` (a copy)."""
    out = mx.array(a)
    return out.view(mx.bfloat16) if name == "bfloat16" else out


@dataclass(frozen=True)
class Record:
    """A record read back: its header fields and its tensors (numpy views of
    the file's bytes, by name; `tensor` makes MLX arrays of them)."""

    header: dict[str, Any]
    tensors: dict[str, np.ndarray]
    dtypes: dict[str, str]
    nbytes: int  # the file's size

    def tensor(self, name: str) -> mx.array:
        try:
            return device_array(self.tensors[name], self.dtypes[name])
        except KeyError:
            raise RecordError(Skip.CORRUPT, f"the record holds no tensor {name!r}") from None


def is_temporary(name: str) -> bool:
    return TEMP_MARK in name


def temporary_name(path: Path) -> Path:
    """A name next to `path` no other writer (process, thread) uses."""
    who = f"{socket.gethostname()}-{os.getpid()}-{threading.get_ident()}"
    return path.with_name(f"{path.name}{TEMP_MARK}{who}")


@dataclass(frozen=True)
class Encoded:
    """A record ready to write: its prefix and header, then its data in file order."""

    head: bytes
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return len(self.head) + sum(p.nbytes for p in self.parts)


def encode(header: dict[str, Any], tensors: Sequence[tuple[str, mx.array]]) -> Encoded:
    """A record of `header` and `tensors` (evaluated MLX arrays, read without a
    copy when contiguous)."""
    table, parts, offset = [], [], 0
    for name, a in tensors:
        host = host_array(a)
        crc = zlib.crc32(host) if host.size else 0
        pad = -offset % _ALIGN
        offset += pad
        table.append([name, dtype_name(a.dtype), list(a.shape), offset, host.nbytes, crc])
        if pad:
            parts.append(np.zeros(pad, np.uint8))
        parts.append(host)
        offset += host.nbytes
    body = dict(header, format=FORMAT, tensors=table, data_bytes=offset)
    text = json.dumps(body, separators=(",", ":")).encode()
    return Encoded(_PREFIX.pack(MAGIC, len(text), zlib.crc32(text)) + text, tuple(parts))


def write_record(path: Path, record: Encoded, pause: Callable[[], None] | None = None) -> int:
    """Write `record` at `path` atomically (a temporary file, fsync, rename);
    returns its size. `pause` runs halfway through the data (tests stop a
    writer there)."""
    tmp = temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    parts = record.parts
    size = len(record.head)
    try:
        os.write(fd, record.head)
        for i, part in enumerate(parts):
            if pause is not None and i == len(parts) // 2:
                pause()
            if not part.nbytes:
                continue
            view = memoryview(part.reshape(-1)).cast("B")
            while view:
                n = os.write(fd, view)
                view = view[n:]
            size += part.nbytes
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def read_header(path: Path, fingerprint: str) -> tuple[dict[str, Any], int, int]:
    """A record's header, where its data starts and the file's size, checked
    (`RecordError` otherwise); the data is not read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise RecordError(Skip.CORRUPT, f"{path.name}: shorter than a record's prefix")
            magic, length, crc = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise RecordError(Skip.CORRUPT, f"{path.name}: not a disk-tier record")
            if length > min(MAX_HEADER, size - _PREFIX.size):
                raise RecordError(Skip.CORRUPT, f"{path.name}: truncated header")
            text = f.read(length)
    except FileNotFoundError:
        raise RecordError(Skip.MISSING, f"{path.name}: gone") from None
    except OSError as e:
        raise RecordError(Skip.CORRUPT, f"{path.name}: cannot be read ({e})") from None
    if zlib.crc32(text) != crc:
        raise RecordError(Skip.CORRUPT, f"{path.name}: header checksum mismatch")
    try:
        header = json.loads(text)
    except ValueError:
        raise RecordError(Skip.CORRUPT, f"{path.name}: header is not JSON") from None
    if not isinstance(header, dict):
        raise RecordError(Skip.CORRUPT, f"{path.name}: header is not an object")
    if header.get("format") != FORMAT:
        raise RecordError(
            Skip.FOREIGN, f"{path.name}: format {header.get('format')}, this server reads {FORMAT}"
        )
    if header.get("fingerprint") != fingerprint:
        raise RecordError(
            Skip.FOREIGN, f"{path.name}: written for another model or KV setting "
            f"(fingerprint {str(header.get('fingerprint'))[:12]}, this server's {fingerprint[:12]})",
        )  # fmt: skip
    start = _PREFIX.size + length
    if header.get("data_bytes") != size - start:
        raise RecordError(
            Skip.CORRUPT, f"{path.name}: {size - start} data bytes, the header says "
            f"{header.get('data_bytes')} (truncated?)",
        )  # fmt: skip
    return header, start, size


def read_record(path: Path, fingerprint: str) -> Record:
    """The record at `path`, every check passed (`RecordError` otherwise)."""
    header, start, size = read_header(path, fingerprint)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except FileNotFoundError:
        raise RecordError(Skip.MISSING, f"{path.name}: gone") from None
    except OSError as e:
        raise RecordError(Skip.CORRUPT, f"{path.name}: cannot be read ({e})") from None
    if len(data) != size - start:
        raise RecordError(Skip.CORRUPT, f"{path.name}: changed while read")
    tensors, dtypes = {}, {}
    try:
        for name, dtype, shape, offset, nbytes, crc in header["tensors"]:
            np_dtype = _NP_DTYPES[dtype]
            count = math.prod(int(x) for x in shape)
            if count * np_dtype.itemsize != nbytes or offset < 0 or offset + nbytes > len(data):
                raise ValueError(f"tensor {name} does not fit its bytes")
            view = memoryview(data)[offset : offset + nbytes]
            if (zlib.crc32(view) if nbytes else 0) != crc:
                raise RecordError(Skip.CORRUPT, f"{path.name}: checksum mismatch in {name}")
            tensors[name] = np.frombuffer(view, dtype=np_dtype, count=count).reshape(shape)
            dtypes[name] = dtype
    except RecordError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise RecordError(Skip.CORRUPT, f"{path.name}: malformed tensor table ({e})") from None
    return Record(header, tensors, dtypes, size)


__all__ = [
    "FORMAT",
    "Encoded",
    "Record",
    "RecordError",
    "Skip",
    "device_array",
    "dtype_name",
    "encode",
    "host_array",
    "is_temporary",
    "read_header",
    "read_record",
    "temporary_name",
    "write_record",
]
