"""The disk tier's directory: what it holds, its byte cap, and this server's index.

Layout under the directory given (`--prompt-cache-dir`):

- `<fingerprint>/c/<xx>/<digest>.kvc`: a *chunk*, the K/V of every paged
  full-attention layer for `chunk_tokens` tokens, named by the chain
  digest of every token up to its end (`chain_digests`): a prefix shared
  by many prompts (a system prompt) is written once;
- `<fingerprint>/e/<xx>/<key>.kve`: an *entry*, one prompt-cache entry's
  tokens past its last whole chunk and what its caches hold besides the
  chunks (the full layers' partly filled chunk, the windows, the layers
  that do not page, or a whole cache in the padded layout);
- `<fingerprint>/fingerprint.json`: what that fingerprint covers;
- `.lock` and `.stamp`: writers (several servers may share a directory)
  evict and write holding the lock, and change the stamp, so that a writer
  that finds another's stamp counts the directory again.

The cap counts the records of every fingerprint (another model's files
too) and is enforced before each write, least recently used first (a file
used is touched). At startup, temporary files of a writer that stopped are
removed, and records of this fingerprint whose header does not check out
are removed with a log line.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .fingerprint import Fingerprint
from .records import RecordError, Skip, is_temporary, read_header

log = logging.getLogger("mlx_kvq.engine")

CHUNK, ENTRY = ".kvc", ".kve"
RECORDS = (CHUNK, ENTRY)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(p)
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def chain_digests(root: bytes, tokens: Sequence[int], chunk_tokens: int) -> list[str]:
    """One digest (hex) per whole chunk of `tokens`, each covering every token
    up to the chunk's end (the previous digest and this chunk's tokens)."""
    out, d = [], root
    data = token_bytes(tokens)
    step = 4 * chunk_tokens
    for i in range(0, len(tokens) // chunk_tokens * step, step):
        d = _digest(d, data[i : i + step])
        out.append(d.hex())
    return out


def entry_key(chain: str, tail: Sequence[int]) -> str:
    """The name of an entry: the digest of its chain and its tokens after it."""
    return _digest(bytes.fromhex(chain), b"entry", token_bytes(tail)).hex()


@dataclass(frozen=True)
class EntryInfo:
    """One entry file of this fingerprint, as the index knows it."""

    path: Path
    chain: str  # the chain digest of those chunks (the fingerprint's when none)
    chunks: int  # whole chunks of tokens before its tail
    tail: tuple[int, ...]  # its tokens after them
    segment: str
    chained: bool  # its caches need the chunk files (paged full-attention layers)
    nbytes: int

    def length(self, chunk_tokens: int) -> int:
        return self.chunks * chunk_tokens + len(self.tail)


@dataclass(frozen=True)
class Census:
    """What the directory held when it was counted."""

    files: int
    nbytes: int
    entries: int  # this fingerprint's
    chunks: int
    foreign_files: int  # records of other fingerprints (models, settings, versions)
    foreign_bytes: int
    removed_temporary: int  # files a writer left when it stopped (at startup)
    removed_invalid: int  # this fingerprint's records that did not check out


class DiskDirectory:
    """The directory and this fingerprint's index; see the module docstring.

    The engine thread reads the index; the writer thread changes the
    directory and the index (under `_lock` for the index, the directory's
    lock file for the directory)."""

    def __init__(self, root: Path, fp: Fingerprint, max_bytes: int, chunk_tokens: int):
        self.root = Path(root)
        self.fp = fp
        self.max_bytes = max_bytes
        self.chunk_tokens = chunk_tokens
        self.home = self.root / fp.digest[:16]
        self._lock = threading.RLock()
        self._files: OrderedDict[Path, int] = OrderedDict()  # least recently used first
        self._chunks: dict[str, int] = {}  # digest -> bytes
        self._entries: dict[str, dict[str, EntryInfo]] = {}  # chain digest -> key -> entry
        self._known: dict[Path, EntryInfo] = {}  # entry headers read, by path
        self.nbytes = 0
        self.evictions = 0
        self.invalid: Counter[str] = Counter()  # records of ours removed by a count, by reason
        self.census: Census | None = None
        self._stamp = ""
        self._writes = 0

    # -- paths ---------------------------------------------------------------------
    def chunk_path(self, digest: str) -> Path:
        return self.home / "c" / digest[:2] / f"{digest}{CHUNK}"

    def entry_path(self, key: str) -> Path:
        return self.home / "e" / key[:2] / f"{key}{ENTRY}"

    @property
    def root_digest(self) -> str:
        return self.fp.digest

    # -- what the index knows ------------------------------------------------------
    def has_chunk(self, digest: str) -> bool:
        return digest in self._chunks

    def chunk_bytes(self, digest: str) -> int:
        return self._chunks.get(digest, 0)

    def entries_after(self, chain: str) -> list[EntryInfo]:
        with self._lock:
            return list(self._entries.get(chain, {}).values())

    def has_entry(self, key: str) -> bool:
        with self._lock:
            return self.entry_path(key) in self._known

    def counts(self) -> tuple[int, int, int, int]:
        """(files, bytes, entries, chunks) as this server last counted."""
        with self._lock:
            return len(self._files), self.nbytes, len(self._known), len(self._chunks)

    # -- opening -------------------------------------------------------------------
    def open(self) -> Census:
        """Create the directory if needed, remove what stopped writers left,
        count what it holds (evicting down to the cap), describe this
        fingerprint. Raises OSError when the directory cannot be used."""
        self.home.mkdir(parents=True, exist_ok=True)
        (self.root / ".lock").touch(exist_ok=True)
        with self.locked():
            removed = self._remove_temporary()
            self._scan()
            self._make_room(0)
            described = self.home / "fingerprint.json"
            if not described.exists():
                tmp = described.with_name(f"fingerprint.json.tmp-{os.getpid()}")
                tmp.write_text(json.dumps(self.fp.description, indent=1, sort_keys=True))
                os.replace(tmp, described)
            self._changed()
        with self._lock:
            foreign = [(p, n) for p, n in self._files.items() if self.home not in p.parents]
            self.census = Census(
                len(self._files), self.nbytes, len(self._known), len(self._chunks),
                len(foreign), sum(n for _, n in foreign), removed, sum(self.invalid.values()),
            )  # fmt: skip
        return self.census

    @contextmanager
    def locked(self) -> Iterator[None]:
        """The directory's lock, shared by every server writing into it."""
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def _walk(self) -> Iterator[os.DirEntry]:
        stack = [self.root]
        while stack:
            try:
                with os.scandir(stack.pop()) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(Path(e.path))
                        elif e.is_file(follow_symlinks=False):
                            yield e
            except FileNotFoundError:
                continue

    def _remove_temporary(self) -> int:
        """Remove temporary files (call holding the lock: no writer is writing)."""
        n = 0
        for e in self._walk():
            if is_temporary(e.name):
                Path(e.path).unlink(missing_ok=True)
                n += 1
        if n:
            log.warning(
                "prompt cache dir %s: removed %d partial file(s) a writer left when it "
                "stopped (never read)", self.root, n,
            )  # fmt: skip
        return n

    def _scan(self) -> None:
        """Count every record and index this fingerprint's (call holding the
        lock); ours that do not check out are removed (`invalid`)."""
        found = []
        for e in self._walk():
            if e.name.endswith(RECORDS) and not is_temporary(e.name):
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((st.st_mtime, Path(e.path), st.st_size))
        found.sort(key=lambda x: x[0])
        files, chunks, entries, known = OrderedDict(), {}, {}, {}
        for _, path, size in found:
            if path.parent.parent.parent == self.home and path.name.endswith(ENTRY):
                info = self._known.get(path)
                if info is None or info.nbytes != size:
                    try:
                        info = self._entry_info(path)
                    except RecordError as e:
                        log.warning("prompt cache dir: %s not used, removed: %s", path, e)
                        path.unlink(missing_ok=True)
                        self.invalid[e.reason.value] += 1
                        continue
                known[path] = info
                entries.setdefault(info.chain, {})[path.stem] = info
            elif path.parent.parent.parent == self.home and path.name.endswith(CHUNK):
                chunks[path.stem] = size
            files[path] = size
        with self._lock:
            self._files, self._chunks, self._entries, self._known = files, chunks, entries, known
            self.nbytes = sum(files.values())

    def _entry_info(self, path: Path) -> EntryInfo:
        header, _, size = read_header(path, self.fp.digest)
        try:
            tail = tuple(int(t) for t in header["tail"])
            info = EntryInfo(
                path, str(header["chain"]), int(header["chunks"]), tail,
                str(header["segment"]), bool(header["chained"]), size,
            )  # fmt: skip
            if entry_key(info.chain, tail) != path.stem:
                raise ValueError("its name is not its tokens' digest")
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(Skip.CORRUPT, f"{path.name}: malformed entry header ({e})") from None
        return info

    # -- changes (the writer thread) -----------------------------------------------
    def refresh(self) -> None:
        """Count the directory again if another writer changed it (call
        holding the lock)."""
        try:
            stamp = (self.root / ".stamp").read_text()
        except OSError:
            stamp = ""
        if stamp != self._stamp:
            self._scan()

    def _changed(self) -> None:
        self._writes += 1
        self._stamp = f"{os.getpid()}-{id(self)}-{self._writes}-{time.time_ns()}"
        (self.root / ".stamp").write_text(self._stamp)

    def _make_room(self, need: int) -> None:
        """Evict least recently used records until `need` more bytes fit."""
        while self._files and self.nbytes + need > self.max_bytes:
            with self._lock:
                path, size = self._files.popitem(last=False)
                self.nbytes -= size
                self._forget(path)
            path.unlink(missing_ok=True)
            self.evictions += 1

    def _forget(self, path: Path) -> None:
        """The index no longer knows `path` (call holding `_lock`)."""
        if path.name.endswith(CHUNK):
            self._chunks.pop(path.stem, None)
        info = self._known.pop(path, None)
        if info is not None:
            group = self._entries.get(info.chain, {})
            group.pop(path.stem, None)
            if not group:
                self._entries.pop(info.chain, None)

    def reserve(self, need: int) -> bool:
        """Room for `need` bytes more, evicting least recently used records
        (call holding the lock); False when `need` exceeds the cap."""
        if need > self.max_bytes:
            return False
        self._make_room(need)
        return True

    def added(self, path: Path, size: int, info: EntryInfo | None = None) -> None:
        """`path` was written (call holding the lock); `info` for an entry."""
        with self._lock:
            old = self._files.pop(path, None)
            if old is not None:
                self.nbytes -= old
            self._files[path] = size
            self.nbytes += size
            if path.name.endswith(CHUNK):
                self._chunks[path.stem] = size
            elif info is not None:
                self._known[path] = info
                self._entries.setdefault(info.chain, {})[path.stem] = info
        self._changed()

    def touch(self, paths: Sequence[Path]) -> None:
        """`paths` were used: the last to be evicted (mtime too, for other servers)."""
        now = time.time()
        for path in paths:
            with self._lock:
                if path not in self._files:
                    continue
                self._files.move_to_end(path)
            try:
                os.utime(path, (now, now))
            except OSError:
                continue

    def discard(self, path: Path) -> None:
        """A record that did not check out (or vanished) leaves the index and the disk."""
        with self._lock:
            size = self._files.pop(path, None)
            if size is not None:
                self.nbytes -= size
            self._forget(path)
        path.unlink(missing_ok=True)

    def describe(self) -> dict[str, Any]:
        return {"directory": str(self.root), "fingerprint": self.fp.digest}


__all__ = [
    "CHUNK",
    "ENTRY",
    "Census",
    "DiskDirectory",
    "EntryInfo",
    "chain_digests",
    "entry_key",
    "token_bytes",
]
