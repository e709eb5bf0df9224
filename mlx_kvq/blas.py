"""Which BLAS MLX's float products run on, and a fast one on Linux.

The `mlx[cpu]` wheel for Linux links the reference (netlib) BLAS, which
multiplies float32 matrices 20-50x slower than OpenBLAS. Speed comparisons
made on it flatter whatever avoids float32 products, so mlx-kvq makes MLX
use OpenBLAS (the `scipy-openblas32` wheel, a dependency on Linux; a system
`libopenblas.so.0` where that is missing) when the program asks for it:
every `mlx-kvq` command does (`mlx_kvq.commands.main`), a Python program
calls `mlx_kvq.use_fast_blas()`. Importing `mlx_kvq` leaves the binding
alone, because the change reaches every float product in the process,
whatever computes it (its rounding differs from the reference BLAS).

How: libmlx calls `cblas_sgemm`, `cblas_dgemm` and `cblas_cgemm` through
its import slots (GOT entries), which the dynamic loader filled with the
reference BLAS's addresses when `mlx.core` was imported. `use_fast_blas`
writes OpenBLAS's addresses into those slots, so it takes effect whenever it is called, whichever
of `mlx` and `mlx_kvq` was imported first, and `use_linked_blas` puts the
linked ones back for a measurement. The slots are found from libmlx's own
relocation tables (ELF x86-64 and AArch64); anything else is left alone and
reported. LAPACK routines (`mx.linalg`) keep the linked library.

`blas_info()` reports what the slot of `cblas_sgemm` holds now, resolved by
the loader (`dladdr`), and how it got there. `MLX_KVQ_BLAS=reference`
(or `linked`, `off`, `0`) opts out; `MLX_KVQ_BLAS=/path/to/lib.so` picks a
library (an LP64 CBLAS: `cblas_*` or `scipy_cblas_*` names).
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import importlib.util
import mmap
import os
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ENV = "MLX_KVQ_BLAS"
OPT_OUT = ("reference", "linked", "off", "0", "none")
SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")
SYSTEM_OPENBLAS = "libopenblas.so.0"


class BlasKind(enum.Enum):
    OPENBLAS = "OpenBLAS"
    MKL = "MKL"
    BLIS = "BLIS"
    ACCELERATE = "Accelerate"
    REFERENCE = "reference BLAS"
    OTHER = "other BLAS"
    UNKNOWN = "unknown"


_FAST = (BlasKind.OPENBLAS, BlasKind.MKL, BlasKind.BLIS, BlasKind.ACCELERATE)


class BlasBinding(enum.Enum):
    LINKED = "as linked"  # what the loader bound when mlx.core was imported
    REBOUND = "rebound by mlx-kvq"


class BlasError(ValueError):
    """`MLX_KVQ_BLAS` names something that cannot be used."""


@dataclass(frozen=True)
class BlasInfo:
    """The library MLX's `cblas_sgemm` calls resolve to, and why."""

    kind: BlasKind
    library: str | None  # file of the function, as the loader reports it
    symbol: str | None  # name of the function in that file
    binding: BlasBinding
    reason: str  # how it got there (the default, the variable, why not fast)
    config: str | None = None  # OpenBLAS's build line, e.g. "OpenBLAS 0.3.34 ... Haswell"
    threads: int | None = None

    @property
    def fast(self) -> bool:
        return self.kind in _FAST

    def summary(self) -> str:
        """One line for logs, `/health` and bench headers."""
        name = self.config or self.kind.value
        where = Path(self.library).name if self.library else "?"
        threads = f", {self.threads} threads" if self.threads else ""
        return f"{name} ({where}{threads}), {self.binding.value}: {self.reason}"

    def to_dict(self) -> dict:
        return {
            "kind": self.kind.value,
            "fast": self.fast,
            "library": self.library,
            "symbol": self.symbol,
            "binding": self.binding.value,
            "reason": self.reason,
            "config": self.config,
            "threads": self.threads,
        }


# -- the loader -----------------------------------------------------------------
class _DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


class _PhdrInfo(ctypes.Structure):
    _fields_ = [("dlpi_addr", ctypes.c_size_t), ("dlpi_name", ctypes.c_char_p)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p
)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
_libc.dlsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_libc.dlsym.restype = ctypes.c_void_p


def _where(address: int) -> tuple[str | None, str | None]:
    """(file, symbol name) the loader maps `address` to."""
    info = _DlInfo()
    if not address or not _libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)):
        return None, None
    fname = info.dli_fname.decode() if info.dli_fname else None
    sname = info.dli_sname.decode() if info.dli_sname else None
    return (os.path.realpath(fname) if fname else None), sname


def _loaded_objects() -> list[tuple[str, int]]:
    """(path, load bias) of every object loaded in this process."""
    found: list[tuple[str, int]] = []

    def visit(info, _size, _data) -> int:
        name = info.contents.dlpi_name
        if name:
            found.append((name.decode(), info.contents.dlpi_addr))
        return 0

    _libc.dl_iterate_phdr(_PHDR_CALLBACK(visit), None)
    return found


def _symbol(lib: ctypes.CDLL, name: str) -> int | None:
    return _libc.dlsym(ctypes.c_void_p(lib._handle), name.encode()) or None


# -- libmlx's import slots ---------------------------------------------------------
# Relocation types that store a symbol's address in a slot (S + A, A = 0):
# x86-64 R_X86_64_64 / GLOB_DAT / JUMP_SLOT, AArch64 ABS64 / GLOB_DAT / JUMP_SLOT.
_SLOT_RELOCATIONS = {62: (1, 6, 7), 183: (257, 1025, 1026)}
_DT = {"STRTAB": 5, "SYMTAB": 6, "RELA": 7, "RELASZ": 8, "PLTRELSZ": 2, "JMPREL": 23}


def _elf_slots(path: str, names: tuple[str, ...]) -> dict[str, list[int]]:
    """Offsets (from the load bias) of the slots where the loader stores the
    addresses of `names`, read from the file's dynamic segment (the tables
    the loader itself uses; section headers are not needed)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return _dynamic_slots(path, data, names)


def _dynamic_slots(path: str, data: mmap.mmap, names: tuple[str, ...]) -> dict[str, list[int]]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise OSError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    if machine not in _SLOT_RELOCATIONS:
        raise OSError(f"{path}: machine {machine} is not x86-64 or AArch64")
    phoff = struct.unpack_from("<Q", data, 32)[0]
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize
        )
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        raise OSError(f"{path}: no dynamic segment")

    def offset(vaddr: int) -> int:
        for start, off, size in loads:
            if start <= vaddr < start + size:
                return vaddr - start + off
        raise OSError(f"{path}: address {vaddr:#x} outside the file's segments")

    tags: dict[int, int] = {}
    for pos in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, pos)
        if tag == 0:
            break
        tags.setdefault(tag, value)
    symtab, strtab = offset(tags[_DT["SYMTAB"]]), offset(tags[_DT["STRTAB"]])
    wanted = {n.encode() for n in names}
    kinds = _SLOT_RELOCATIONS[machine]
    slots: dict[str, list[int]] = {}
    sym_names: dict[int, bytes] = {}
    for table, size in (("RELA", "RELASZ"), ("JMPREL", "PLTRELSZ")):
        if _DT[table] not in tags:
            continue
        start = offset(tags[_DT[table]])
        for pos in range(start, start + tags.get(_DT[size], 0), 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, pos)
            sym, rtype = r_info >> 32, r_info & 0xFFFFFFFF
            if sym == 0 or rtype not in kinds:
                continue
            if sym not in sym_names:
                st_name = struct.unpack_from("<I", data, symtab + 24 * sym)[0]
                end = data.find(b"\0", strtab + st_name)
                sym_names[sym] = data[strtab + st_name : end]
            if sym_names[sym] in wanted:
                slots.setdefault(sym_names[sym].decode(), []).append(r_offset)
    return slots


def _page_protection(address: int) -> int:
    """PROT_* flags of the mapping holding `address` (from /proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                return (
                    (mmap.PROT_READ if perms[0] == "r" else 0)
                    | (mmap.PROT_WRITE if perms[1] == "w" else 0)
                    | (mmap.PROT_EXEC if perms[2] == "x" else 0)
                )
    raise OSError(f"address {address:#x} is not mapped")


def _write_slot(address: int, value: int) -> None:
    """Store a function address in an import slot, lifting the slot page's
    write protection (RELRO) for the write only."""
    prot = _page_protection(address)
    page = address & ~(mmap.PAGESIZE - 1)
    mprotect = _libc.mprotect
    mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if not prot & mmap.PROT_WRITE:
        if mprotect(page, mmap.PAGESIZE, prot | mmap.PROT_WRITE) != 0:
            raise OSError(ctypes.get_errno(), "mprotect of an import slot failed")
    try:
        ctypes.c_void_p.from_address(address).value = value
    finally:
        if not prot & mmap.PROT_WRITE:
            mprotect(page, mmap.PAGESIZE, prot)


@dataclass(frozen=True)
class _Slots:
    """libmlx's import slots for `SYMBOLS` and what the loader put there."""

    library: str
    addresses: dict[str, tuple[int, ...]]
    linked: dict[str, int]

    def current(self, name: str = "cblas_sgemm") -> int:
        return ctypes.c_void_p.from_address(self.addresses[name][0]).value or 0

    def bind(self, targets: dict[str, int]) -> None:
        for name, target in targets.items():
            for address in self.addresses[name]:
                _write_slot(address, target)


def _libmlx_path() -> str | None:
    import mlx.core  # noqa: F401  (loads libmlx)

    spec = importlib.util.find_spec("mlx")
    roots = [os.path.realpath(p) for p in (spec.submodule_search_locations or [])]
    for name, _ in _loaded_objects():
        real = os.path.realpath(name)
        if Path(real).name.startswith("libmlx.") and any(real.startswith(r) for r in roots):
            return real
    return None


# what this process found and did: "slots" (_Slots or why not), "library" (the
# loaded fast library, kept alive), "why_linked" / "why_rebound" (reasons)
_state: dict[str, object] = {}


def _find_slots() -> _Slots | str:
    """libmlx's slots, or why they cannot be used."""
    if "slots" in _state:
        return _state["slots"]  # type: ignore[return-value]
    result: _Slots | str
    if not sys.platform.startswith("linux"):
        result = f"not Linux ({sys.platform}): MLX's own BLAS is kept"
    else:
        path = _libmlx_path()
        if path is None:
            result = "libmlx is not a separate loaded library here: MLX's own BLAS is kept"
        else:
            bias = next(b for n, b in _loaded_objects() if os.path.realpath(n) == path)
            try:
                offsets = _elf_slots(path, SYMBOLS)
            except OSError as e:
                result = f"cannot read libmlx's import slots: {e}"
            else:
                if set(offsets) != set(SYMBOLS):
                    missing = sorted(set(SYMBOLS) - set(offsets))
                    result = f"libmlx does not import {', '.join(missing)}"
                else:
                    addresses = {n: tuple(bias + o for o in offsets[n]) for n in SYMBOLS}
                    linked = {
                        n: ctypes.c_void_p.from_address(a[0]).value or 0
                        for n, a in addresses.items()
                    }
                    result = _Slots(path, addresses, linked)
    _state["slots"] = result
    return result


# -- identifying and finding libraries -------------------------------------------------
_MARKERS = (
    (BlasKind.OPENBLAS, ("openblas_get_config", "scipy_openblas_get_config")),
    (BlasKind.MKL, ("MKL_Get_Version", "mkl_get_version")),
    (BlasKind.BLIS, ("bli_info_get_version_str",)),
)


def _describe(path: str | None) -> tuple[BlasKind, str | None, int | None]:
    """(kind, OpenBLAS build line, OpenBLAS threads) of a loaded library."""
    if path is None:
        return BlasKind.UNKNOWN, None, None
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return BlasKind.UNKNOWN, None, None
    for kind, markers in _MARKERS:
        for marker in markers:
            fn = _symbol(lib, marker)
            if fn is None:
                continue
            if kind is not BlasKind.OPENBLAS:
                return kind, None, None
            prefix = marker[: -len("openblas_get_config")]
            config = ctypes.CFUNCTYPE(ctypes.c_char_p)(fn)().decode()
            threads_fn = _symbol(lib, prefix + "openblas_get_num_threads")
            threads = ctypes.CFUNCTYPE(ctypes.c_int)(threads_fn)() if threads_fn else None
            return kind, config, threads
    name = Path(path).name
    if name.startswith("libblas") or name.startswith("libcblas"):
        return BlasKind.REFERENCE, None, None
    if "Accelerate" in path or "vecLib" in path:
        return BlasKind.ACCELERATE, None, None
    return BlasKind.OTHER, None, None


def _scipy_openblas() -> str | None:
    spec = importlib.util.find_spec("scipy_openblas32")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        libs = sorted((Path(root) / "lib").glob("libscipy_openblas*.so*"))
        if libs:
            return str(libs[0])
    return None


def _open(path: str) -> tuple[ctypes.CDLL, dict[str, int]] | str:
    """A library and its addresses of `SYMBOLS` (plain or `scipy_` names),
    or why it cannot be used."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    except OSError as e:
        return f"cannot load {path}: {e}"
    for prefix in ("", "scipy_"):
        targets = {n: _symbol(lib, prefix + n) for n in SYMBOLS}
        if all(targets.values()):
            return lib, targets  # type: ignore[return-value]
    return f"{path} does not export {', '.join(SYMBOLS)}"


def _candidates() -> list[tuple[str, str]]:
    """(library, why this one) in order of preference, from `MLX_KVQ_BLAS`."""
    value = os.environ.get(ENV, "").strip()
    if value and value.lower() not in ("auto", "fast"):
        if not os.path.exists(value):
            raise BlasError(
                f"{ENV}={value!r}: no such file; set it to a BLAS library's path, "
                f"to one of {', '.join(OPT_OUT)} (keep MLX's linked BLAS), or unset it"
            )
        return [(value, f"{ENV}={value}")]
    found = []
    bundled = _scipy_openblas()
    if bundled:
        found.append((bundled, "default: the scipy-openblas32 package"))
    found.append((SYSTEM_OPENBLAS, "default: the system OpenBLAS"))
    return found


# -- public ---------------------------------------------------------------------------
def opted_out() -> bool:
    return os.environ.get(ENV, "").strip().lower() in OPT_OUT


def blas_info() -> BlasInfo:
    """What MLX's `cblas_sgemm` calls resolve to now (read from libmlx's
    import slot and resolved by the loader), and how it got there."""
    slots = _find_slots()
    if isinstance(slots, str):
        address = _libc.dlsym(None, b"cblas_sgemm") or 0
        library, symbol = _where(address)
        kind, config, threads = _describe(library)
        return BlasInfo(kind, library, symbol, BlasBinding.LINKED, slots, config, threads)
    address = slots.current()
    library, symbol = _where(address)
    kind, config, threads = _describe(library)
    if address == slots.linked["cblas_sgemm"]:
        reason = str(
            _state.get(
                "why_linked", "not rebound: mlx-kvq commands and mlx_kvq.use_fast_blas() rebind it"
            )
        )
        return BlasInfo(kind, library, symbol, BlasBinding.LINKED, reason, config, threads)
    reason = str(_state.get("why_rebound", "rebound"))
    return BlasInfo(kind, library, symbol, BlasBinding.REBOUND, reason, config, threads)


_kinds: dict[int, BlasKind] = {}  # library kind by function address


def fast_float32_products() -> bool:
    """Whether MLX's float32 products run on a fast BLAS now. Cheap (one
    slot read once the library at that address is known): attention asks
    it per call to choose its product dtype."""
    slots = _find_slots()
    if isinstance(slots, str):
        address = _libc.dlsym(None, b"cblas_sgemm") or 0
    else:
        address = slots.current()
    if address not in _kinds:
        _kinds[address] = _describe(_where(address)[0])[0]
    kind = _kinds[address]
    return kind in _FAST or (kind is BlasKind.UNKNOWN and sys.platform == "darwin")


def use_fast_blas() -> BlasInfo:
    """Point MLX's BLAS calls at a fast library unless opted out or already
    fast. Idempotent; raises `BlasError` when `MLX_KVQ_BLAS` names a library
    that cannot be used."""
    slots = _find_slots()
    if isinstance(slots, str):
        return blas_info()
    linked_kind = _describe(_where(slots.linked["cblas_sgemm"])[0])[0]
    if opted_out():
        _state["why_linked"] = f"{ENV}={os.environ[ENV]} (opted out)"
        slots.bind(slots.linked)
        return blas_info()
    explicit = bool(os.environ.get(ENV, "").strip().lower() not in ("", "auto", "fast"))
    if linked_kind is not BlasKind.REFERENCE and not explicit:
        _state["why_linked"] = "MLX links it (not the reference BLAS): left as it is"
        return blas_info()
    reasons = []
    for path, why in _candidates():
        opened = _open(path)
        if isinstance(opened, str):
            if explicit:
                raise BlasError(f"{ENV}: {opened}")
            reasons.append(opened)
            continue
        lib, targets = opened
        _state["library"] = lib  # keep it loaded
        _state["fast"] = targets
        _state["why_rebound"] = why
        slots.bind(targets)
        return blas_info()
    _state["why_linked"] = "no fast BLAS found (" + "; ".join(reasons) + ")"
    return blas_info()


@contextlib.contextmanager
def use_linked_blas() -> Iterator[BlasInfo]:
    """Run the block on the BLAS MLX was linked with (the reference BLAS of
    the Linux wheel), then restore the binding that was in place: for
    measurements that need both in one process."""
    slots = _find_slots()
    if isinstance(slots, str):
        yield blas_info()
        return
    before = {n: slots.current(n) for n in SYMBOLS}
    reason = _state.get("why_linked")
    _state["why_linked"] = "use_linked_blas(): measuring the linked BLAS"
    slots.bind(slots.linked)
    try:
        yield blas_info()
    finally:
        slots.bind(before)
        _state["why_linked"] = reason
