"""The prompt cache's disk tier: entries kept on disk across evictions and restarts.

Two hooks connect it to the engine, both in the memory accounting
(`memory.KVMemory`):

- `keep`, whenever a sequence's caches are stored in the prompt cache (a
  prompt's cuts, an answer, a preempted sequence): the entry is written
  through, in its quantized form, by the writer thread. Chunks already on
  disk (a shared system prompt) are not written again, only touched; the
  engine thread copies out what is new (bounded by the writer's queue:
  what does not fit is left for a later entry, and counted) and never
  waits for the disk. Writing through, rather than when memory evicts an
  entry, keeps what a restart or a crash would otherwise lose (the system
  prompt, the last evicted, would never reach the disk) and needs no copy
  at the moment memory runs short.
- `restore`, when a sequence is about to be admitted: if the disk holds a
  longer prefix of its tokens than the prompt cache in memory, that
  prefix is read back (synchronously; its bytes are those the sequence
  would otherwise compute and hold, and reading them costs a fraction of
  prefilling them) into the block pools, reusing the blocks memory still
  holds for its start, and stored in the prompt cache as the entry it was.
  The sequence is then admitted as any sequence whose prefix is cached.

A prefix is found either as an entry (its chunks and its file: exactly the
tokens it was stored for) or, when every layer is a paged full-attention
layer, as the longest run of chunks from the start (any prefix of them is
a cache). A file that does not check out is skipped with a log line,
removed, and the request computes its prefix.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx

from mlx_kvq.caches import KVQPagedSequence, Pages, page_caches
from mlx_kvq.caches.paged import BlockTable

from ..requests import Segment
from .directory import DiskDirectory, EntryInfo, chain_digests, entry_key
from .entries import (
    Form,
    LeafForm,
    PoolSpec,
    append,
    assemble,
    gather_chunks,
    gather_tail,
    leaf_forms,
    release,
    slot_leaves,
    state_leaf,
    state_tensors,
    tokens_of,
    window_sequence,
)
from .fingerprint import fingerprint
from .records import Record, RecordError, Skip, read_record
from .writer import QUEUE_BYTES, DiskWriter, WriteJob

log = logging.getLogger("mlx_kvq.engine")

CHUNK_TOKENS = 256  # tokens per chunk file (a whole number of blocks)
DEFAULT_DISK_BYTES = 10 << 30  # --prompt-cache-disk-bytes without a value
READ_ATTEMPTS = 3  # prefixes tried when files do not check out
CLOSE_TIMEOUT_S = 30.0  # at shutdown, how long queued files may take to be written


@dataclass(frozen=True)
class DiskSettings:
    """`--prompt-cache-dir` and its cap."""

    directory: str
    max_bytes: int = DEFAULT_DISK_BYTES
    write_gate: str | None = None  # tests: each write waits halfway until this file exists
    chunk_tokens: int = CHUNK_TOKENS  # tokens per chunk file (rounded to whole blocks)


@dataclass(frozen=True)
class DiskTierStats:
    """The disk tier as of now (bytes and files as this server last counted
    the directory, every model's records included)."""

    directory: str
    max_bytes: int
    nbytes: int
    files: int
    entries: int  # this model and setting's entry files
    chunks: int
    hits: int  # sequences that read their prefix from disk
    misses: int  # sequences for which the disk held nothing longer than memory
    tokens_read: int  # prompt tokens read from disk instead of computed
    writes: int  # files written
    bytes_written: int
    evictions: int  # files removed for the cap
    queued_bytes: int
    foreign_bytes: int  # other models' and settings' records found at startup
    skips: tuple[tuple[str, int], ...] = ()  # (reason, count)


class Staging(Protocol):
    """What the tier asks of the memory accounting (`memory.KVMemory`)."""

    prompt_cache: Any

    def covered(self, tokens: Sequence[int]) -> int: ...

    def cache_budget(self) -> int | None: ...

    def store_prompt(self, tokens: list[int], cache: list, segment: Segment) -> bool: ...


@dataclass(frozen=True)
class Found:
    """The longest prefix of a prompt the disk holds."""

    length: int
    chunks: int
    digests: tuple[str, ...]
    entry: EntryInfo | None  # None: a run of chunks alone


class DiskTier:
    """The disk tier of one engine; see the module docstring."""

    def __init__(
        self,
        directory: DiskDirectory,
        writer: DiskWriter,
        pages: Pages | None,
        pools: dict[tuple[int, int | None], PoolSpec],
        template: list[LeafForm],
        chunk_blocks: int,
    ):
        self.directory = directory
        self.writer = writer
        self.pages = pages
        self.pools = pools
        self.template = template  # the forms of a fresh sequence's leaves
        self.chunk_tokens = directory.chunk_tokens
        self.chunk_blocks = chunk_blocks
        # every layer a paged full-attention one: any run of chunks is a cache
        self.chains_alone = bool(template) and all(f.form is Form.FULL for f in template)
        self.min_gain = max(16, pages.block_size if pages is not None else 0)
        self.staging: Staging | None = None
        self._hits = self._misses = self._tokens = 0
        self._skips: Counter[str] = Counter()
        self._said: set[str] = set()
        self._last_request: int | None = None
        self._restoring = False

    # ------------------------------------------------------------ writing
    def keep(self, tokens: Sequence[int], caches: list, segment: Segment) -> None:
        """Write the entry `caches` (holding `tokens`) through to disk: what is
        not there yet, as far as the writer's queue has room."""
        if self._restoring or not tokens:
            return
        forms = leaf_forms(caches)
        if isinstance(forms, str):
            self._once(Skip.UNSUPPORTED, f"prompt cache entries are not written to disk: {forms}")
            return
        leaves = [leaf for _, _, leaf in slot_leaves(caches)]
        n_tokens = len(tokens)
        full = [(f, leaf) for f, leaf in zip(forms, leaves, strict=True) if f.form is Form.FULL]
        if any(leaf.table.base or leaf.table.length != n_tokens for _, leaf in full):
            self._once(Skip.UNSUPPORTED, "a paged entry does not hold its tokens from the start")
            return
        d = self.directory
        C = self.chunk_tokens
        n = n_tokens // C
        digests = chain_digests(self.directory.fp.root, tokens[: n * C], C)
        chain = digests[-1] if digests else d.root_digest
        key = entry_key(chain, tokens[n * C :])
        entry = d.entry_path(key)
        used = [d.chunk_path(x) for x in digests if full and d.has_chunk(x)]
        if d.has_entry(key):
            used.append(entry)
        self.writer.touch(used)  # before the writes below: the cap evicts them last
        if not d.has_entry(key) and not self.writer.pending(entry):
            self._write_entry(entry, forms, leaves, tokens, digests, chain, segment, bool(full))
        if full:
            self._write_chunks(full, tokens, digests)

    def _write_entry(self, path, forms, leaves, tokens, digests, chain, segment, chained) -> None:
        C = self.chunk_tokens
        n = len(digests)
        tensors, described = [], []
        for form, leaf in zip(forms, leaves, strict=True):
            d = form.header()
            if form.form is Form.STATE:
                try:
                    arrays, scalars = state_tensors(leaf)
                except TypeError as e:
                    self._once(Skip.UNSUPPORTED, f"prompt cache entries are not written: {e}")
                    return
                tensors += [(f"{form.name}/{k}", a) for k, a in arrays]
                d.update(arrays=[k for k, _ in arrays], scalars=scalars,
                         order=[k for k, _ in arrays] + list(scalars))  # fmt: skip
            else:
                start = n * C if form.form is Form.FULL else leaf.table.base
                tensors += [(f"{form.name}.{p}", a) for p, a in gather_tail(leaf, start)]
                d["start"] = start
            described.append(d)
        mx.eval([a for _, a in tensors])
        nbytes = sum(a.nbytes for _, a in tensors)
        info = EntryInfo(path, chain, n, tuple(tokens[n * C :]), segment.value, chained, 0)
        header = {
            "kind": "entry", "fingerprint": self.directory.fp.digest, "chain": chain,
            "chunks": n, "tail": list(info.tail), "length": len(tokens),
            "segment": segment.value, "chained": chained, "leaves": described,
        }  # fmt: skip
        self.writer.offer(WriteJob(path, header, tuple(tensors), nbytes, info))

    def _write_chunks(self, full, tokens, digests) -> None:
        d = self.directory
        C = self.chunk_tokens
        missing = [
            i for i, x in enumerate(digests)
            if not d.has_chunk(x) and not self.writer.pending(d.chunk_path(x))
        ]  # fmt: skip
        if not missing:
            return
        per_token = sum(
            sum(a.nbytes // (a.shape[0] * a.shape[1]) for a in (*s.keys.parts, *s.values.parts))
            for s in (leaf.pool.storage for _, leaf in full)
        )
        fit = self.writer.room() // max(1, per_token * C)
        if fit < len(missing):
            self.writer.count(Skip.QUEUE_FULL)  # the rest waits for a later entry
            missing = missing[:fit]
        names = [f.name for f, _ in full]
        for first, count in _runs(missing):
            chunks = gather_chunks(full, first, count, self.chunk_blocks)
            for c, tensors in enumerate(chunks):
                i = first + c
                header = {
                    "kind": "chunk", "fingerprint": d.fp.digest, "index": i,
                    "previous": digests[i - 1] if i else d.root_digest, "digest": digests[i],
                    "tokens": list(tokens[i * C : (i + 1) * C]), "leaves": names,
                }  # fmt: skip
                nbytes = sum(a.nbytes for _, a in tensors)
                if not self.writer.offer(
                    WriteJob(d.chunk_path(digests[i]), header, tuple(tensors), nbytes)
                ):
                    return

    # ------------------------------------------------------------ reading
    def find(self, tokens: Sequence[int]) -> Found | None:
        """The longest prefix of `tokens` (all but the last token at most) the
        disk holds, by the index."""
        d = self.directory
        C = self.chunk_tokens
        limit = len(tokens) - 1
        digests = chain_digests(d.fp.root, tokens[: limit // C * C], C)
        run = 0
        while run < len(digests) and d.has_chunk(digests[run]):
            run += 1
        best: Found | None = None
        for n in range(len(digests), -1, -1):
            if best is not None and best.length >= n * C + C:
                break
            chain = digests[n - 1] if n else d.root_digest
            for info in d.entries_after(chain):
                length = n * C + len(info.tail)
                if info.chunks != n or length > limit or (info.chained and n > run):
                    continue
                if tuple(tokens[n * C : length]) != info.tail:
                    continue
                if best is None or length > best.length:
                    best = Found(length, n, tuple(digests[:n]), info)
        if self.chains_alone and run and (best is None or run * C > best.length):
            best = Found(run * C, run, tuple(digests[:run]), None)
        return best

    def restore(self, request_id: int, tokens: Sequence[int]) -> int:
        """Read the longest prefix of `tokens` the disk holds beyond what the
        prompt cache in memory covers into the prompt cache; returns the
        tokens read (0: none)."""
        if self.staging is None or len(tokens) < 2:
            return 0
        first = request_id != self._last_request
        self._last_request = request_id
        have = self.staging.covered(tokens)
        for _ in range(READ_ATTEMPTS):
            found = self.find(tokens)
            if found is None or found.length < have + self.min_gain:
                break
            read = self._read(request_id, tokens, found, have, first)
            if read is not None:
                return read
        if first:
            self._misses += 1
        return 0

    def _room(self) -> int | None:
        caps = [self.staging.cache_budget(), self.staging.prompt_cache.max_bytes]
        caps = [c for c in caps if c is not None]
        return min(caps) if caps else None

    def _read(self, request_id, tokens, found: Found, have: int, first: bool) -> int | None:
        """Read `found` into the prompt cache: the tokens read, 0 when it does
        not fit in memory, None when a file did not check out (removed)."""
        t0 = time.perf_counter()
        d = self.directory
        leaves: list[Any] = []
        path: Path | None = None
        try:
            entry = None
            if found.entry is not None:
                path = found.entry.path
                entry = read_record(path, d.fp.digest)
            forms = self.template if entry is None else self._check_entry(entry, found)
            full = [f for f in forms if f.form is Form.FULL]
            held = self.pages.match(tokens[: found.length + 1]) if full else {}
            matched = self._matched(held, found.length, full)
            first_chunk = matched // self.chunk_tokens if full else found.chunks
            need = sum(d.chunk_bytes(x) for x in found.digests[first_chunk:])
            need += 0 if entry is None else entry.nbytes
            room = self._room()
            if room is not None and need > room:
                if first:
                    self._skips[Skip.NO_ROOM.value] += 1
                    log.info(
                        "request %d: %d prompt tokens on disk not read: the prompt cache has "
                        "room for %d of their %d bytes", request_id, found.length, room, need,
                    )  # fmt: skip
                return 0
            chunks = []
            for i in range(first_chunk, found.chunks):
                path = d.chunk_path(found.digests[i])
                chunks.append(read_record(path, d.fp.digest))
                self._check_chunk(chunks[-1], found, tokens, i, [f.name for f in full])
            path = None
            built = self._build(forms, found, entry, chunks, held, matched, leaves)
        except RecordError as e:
            release(leaves)
            self._skips[e.reason.value] += 1
            log.warning(
                "request %d: prompt cache file not used (%s), its prefix is computed: %s",
                request_id, e.reason.value, e,
            )  # fmt: skip
            if path is not None:
                d.discard(path)
            return None
        segment = Segment(found.entry.segment) if found.entry is not None else Segment.CONTEXT
        self._restoring = True
        try:
            caches = assemble(forms, built)
            stored = self.staging.store_prompt(list(tokens[: found.length]), caches, segment)
        finally:
            self._restoring = False
        if not stored or self.staging.covered(tokens) < found.length:  # refused, or evicted
            release(leaves)  # at once (the prompt cache's order: answers, prefixes, systems)
            if first:
                self._skips[Skip.NO_ROOM.value] += 1
            return 0
        used = [d.chunk_path(x) for x in found.digests] if full else []
        self.writer.touch(used + ([found.entry.path] if found.entry is not None else []))
        self._hits += 1
        self._tokens += found.length - have
        log.info(
            "request %d: %d prompt tokens read from the prompt cache dir (%d of them mapped "
            "from memory; %d files, %.1f MB) in %.2fs instead of prefilled",
            request_id, found.length, matched, len(chunks) + (entry is not None), need / 1e6,
            time.perf_counter() - t0,
        )  # fmt: skip
        return found.length - have

    def _build(self, forms, found: Found, entry, chunks, held, matched, leaves) -> list:
        """The leaves of `found` from its records (the FULL leaves starting from
        the `matched` tokens memory's blocks hold), written into the pools;
        every paged leaf made is added to `leaves` (released on failure)."""
        C = self.chunk_tokens
        first = found.chunks - len(chunks)
        pieces = [(r, max(0, matched - (first + i) * C)) for i, r in enumerate(chunks)]
        if entry is not None:
            pieces.append((entry, max(0, matched - found.chunks * C)))
        built = []
        for i, f in enumerate(forms):
            spec = self.pools.get(f.key)
            if f.form is Form.FULL:
                pool = self.pages.pool(f.key, spec.key_spec, spec.value_spec, spec.window)
                ids = held.get(f.key, [])[: matched // pool.block_size]
                pool.incref(ids)
                leaf = KVQPagedSequence(pool, None, BlockTable(pool, list(ids), 0, matched))
                leaves.append(leaf)
                if pieces:
                    k, v = tokens_of(pieces, f, spec)
                    append(leaf, k, v, f.name, found.length)
                if leaf.table.length != found.length:
                    raise RecordError(Skip.CORRUPT, f"layer {f.name}: the files hold other lengths")
            elif f.form is Form.WINDOW:
                k, v = tokens_of([(entry, 0)], f, spec)
                if int(entry.header["leaves"][i]["start"]) + k.parts[0].shape[0] != found.length:
                    raise RecordError(Skip.CORRUPT, f"layer {f.name}: its window ends elsewhere")
                leaf = window_sequence(self.pages, f, spec, k, v, found.length)
                leaves.append(leaf)
            else:
                leaf = state_leaf(f, entry, entry.header["leaves"][i])
            built.append(leaf)
        return built

    def _matched(self, held: dict, length: int, full: list[LeafForm]) -> int:
        """Tokens at the start of the prefix whose blocks every FULL leaf's pool
        holds already (`held`: `Pages.match`; they are mapped, not read)."""
        if not full:
            return 0
        blocks = min(len(held.get(f.key, [])) for f in full)
        return min(blocks * self.pages.block_size, length)

    def _check_entry(self, record: Record, found: Found) -> list[LeafForm]:
        h = record.header
        info = found.entry
        try:
            ok = (
                h["kind"] == "entry" and h["chain"] == info.chain and int(h["chunks"]) == info.chunks
                and tuple(h["tail"]) == info.tail and int(h["length"]) == found.length
            )  # fmt: skip
            forms = [LeafForm.from_header(x) for x in h["leaves"]]
        except (KeyError, TypeError, ValueError) as e:
            raise RecordError(Skip.CORRUPT, f"{info.path.name}: malformed entry ({e})") from None
        if not ok:
            raise RecordError(Skip.CORRUPT, f"{info.path.name}: holds other tokens than its name")
        for f in forms:
            if f.form is not Form.STATE and (f.key not in self.pools or self.pages is None):
                raise RecordError(Skip.FOREIGN, f"layer {f.name} does not page in this layout")
        return forms

    def _check_chunk(self, record: Record, found: Found, tokens, i: int, names: list[str]) -> None:
        h = record.header
        C = self.chunk_tokens
        want_prev = found.digests[i - 1] if i else self.directory.root_digest
        try:
            ok = (
                h["kind"] == "chunk" and h["digest"] == found.digests[i]
                and h["previous"] == want_prev and list(h["tokens"]) == list(tokens[i * C : (i + 1) * C])
                and set(names) <= set(h["leaves"])
            )  # fmt: skip
        except (KeyError, TypeError) as e:
            raise RecordError(Skip.CORRUPT, f"chunk {i}: malformed header ({e})") from None
        if not ok:
            raise RecordError(
                Skip.CORRUPT, f"chunk {i}: holds other tokens or layers than its name"
            )

    # ------------------------------------------------------------ reporting
    def _once(self, reason: Skip, message: str) -> None:
        self.writer.count(reason)
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)

    def stats(self) -> DiskTierStats:
        files, nbytes, entries, chunks = self.directory.counts()
        w = self.writer.counts()
        skips = Counter(w.skips) + self._skips + self.directory.invalid
        census = self.directory.census
        return DiskTierStats(
            str(self.directory.root), self.directory.max_bytes, nbytes, files, entries, chunks,
            self._hits, self._misses, self._tokens, w.writes, w.bytes_written,
            self.directory.evictions, w.queued_bytes, census.foreign_bytes if census else 0,
            tuple(sorted(skips.items())),
        )  # fmt: skip

    def flush(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until what is queued is written (tests, shutdown)."""
        return self.writer.flush(timeout)

    def close(self) -> None:
        self.writer.close(CLOSE_TIMEOUT_S)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted `indices` as (first, count)."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


def open_tier(
    settings: DiskSettings,
    model: Any,
    plan: Any,
    block_size: int | None,
    paged: frozenset,
    pages: Pages | None,
) -> DiskTier:
    """The disk tier for `model` under `plan` in this layout: the directory
    opened and counted (OSError when it cannot be used), the writer started."""
    if block_size:
        chunk_blocks = max(1, settings.chunk_tokens // block_size)
        chunk_tokens = chunk_blocks * block_size
    else:
        chunk_blocks, chunk_tokens = 0, settings.chunk_tokens
    template_caches = plan.make_cache()
    pools: dict = {}
    if block_size:
        probe = Pages(block_size)
        template_caches = page_caches(template_caches, probe)
        pools = {k: PoolSpec(p.key_spec, p.value_spec, p.window) for k, p in probe.pools.items()}
    template = leaf_forms(template_caches)
    if isinstance(template, str):
        template = []
    fp = fingerprint(model, plan, block_size, paged, chunk_tokens)
    directory = DiskDirectory(Path(settings.directory), fp, settings.max_bytes, chunk_tokens)
    census = directory.open()
    log.info(
        "prompt cache dir %s: cap %.2f GB; %d entries and %d chunks of this model and KV "
        "setting (fingerprint %s), %d files in all (%.2f GB)%s",
        settings.directory, settings.max_bytes / 1e9, census.entries, census.chunks,
        fp.digest[:16], census.files, census.nbytes / 1e9,
        f"; {census.foreign_files} files ({census.foreign_bytes / 1e9:.2f} GB) of other models, "
        "settings or versions, never loaded, counted against the cap"
        if census.foreign_files else "",
    )  # fmt: skip
    writer = DiskWriter(directory, min(QUEUE_BYTES, settings.max_bytes), settings.write_gate)
    return DiskTier(directory, writer, pages, pools, template, chunk_blocks)


__all__ = [
    "CHUNK_TOKENS",
    "DEFAULT_DISK_BYTES",
    "DiskSettings",
    "DiskTier",
    "DiskTierStats",
    "Found",
    "Staging",
    "open_tier",
]
