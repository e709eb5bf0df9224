"""GGUF files in, mlx-lm directories out.

``convert(FILE.gguf, DIR)`` writes what ``mlx_lm.load`` reads: config.json,
model.safetensors, tokenizer.json and tokenizer_config.json (the chat template
included), and ``gguf.json``, what was done with every tensor. Block types that
are MLX's affine quantization exactly stay packed (``tensors.py``); the rest is
dequantized to the dense dtype: float32 on MLX's CPU backend, whose float
products run on the BLAS, float16 elsewhere.

``--model FILE.gguf`` on any command converts once into a cache directory
(``converted``) and loads that; the architecture is checked from the metadata
before any weight is read (``check``), so an unsupported file exits at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .architectures import (
    ARCHITECTURES,
    Metadata,
    UnsupportedModel,
    architecture,
    llama3_rope_scaling,
)
from .reader import GGUFError, TensorInfo, read
from .tensors import Treatment, decode_affine, dequantize, maps_exactly
from .vocab import build_vocab

__all__ = [
    "ARCHITECTURES",
    "as_directory",
    "CONVERTER_VERSION",
    "Conversion",
    "UnsupportedModel",
    "cache_root",
    "check",
    "convert",
    "converted",
    "default_dtype",
    "is_gguf",
    "read_conversion",
]

CONVERTER_VERSION = 1
MANIFEST = "gguf.json"
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Conversion:
    """What a conversion did (`gguf.json`): the source, the dtype of the dense
    tensors, how many tensors of each GGUF type got which treatment, and the
    bytes held against the file's size."""

    source: str
    source_bytes: int
    source_mtime_ns: int
    architecture: str
    model_type: str
    dtype: str
    treatments: dict[str, dict[str, int]]  # GGUF type -> {treatment: tensors}
    bytes_held: int
    converter_version: int = CONVERTER_VERSION

    @property
    def ratio(self) -> float:
        return self.bytes_held / max(self.source_bytes, 1)

    def summary(self) -> str:
        """One line: what became of the weights, and their bytes."""
        parts = []
        for kind, counts in sorted(self.treatments.items()):
            for treatment, n in sorted(counts.items()):
                parts.append(f"{n} {kind} {treatment}")
        return (
            f"{Path(self.source).name} ({self.architecture} -> mlx-lm {self.model_type}): "
            f"{', '.join(parts)} (dense tensors in {self.dtype}); weights held "
            f"{self.bytes_held / 2**20:,.1f} MiB, {self.ratio:.2f}x the file's "
            f"{self.source_bytes / 2**20:,.1f} MiB"
        )


def is_gguf(path: str | os.PathLike | None) -> bool:
    """Whether `path` names a GGUF file: by its `.gguf` name (an absent one
    too, so that it is reported missing rather than taken for a hub id), or by
    its magic number."""
    if path is None:
        return False
    if str(path).lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def default_dtype() -> str:
    """The dense dtype for this backend: float32 on the CPU (its float products
    use the BLAS; half-precision ones do not), float16 elsewhere."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "float16"


def _read(path: str | os.PathLike) -> tuple[Metadata, list[TensorInfo]]:
    try:
        values, tensors = read(path)
    except (OSError, GGUFError) as e:
        raise UnsupportedModel(f"{path}: not a readable GGUF file ({e})") from e
    return Metadata(values, frozenset(t.name for t in tensors)), tensors


def check(path: str | os.PathLike) -> dict:
    """The mlx-lm config of a GGUF file from its metadata alone (no weight is
    read): UnsupportedModel names an architecture or setting that cannot be
    converted."""
    meta, _ = _read(path)
    return architecture(meta).config(meta)


def _dtype(name: str):
    import mlx.core as mx

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(mx, name)


def convert(
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str | None = None,
    dequantize_all: bool = False,
) -> Conversion:
    """Write the mlx-lm directory of a GGUF file into `out_dir` (created);
    `dequantize_all` makes every weight dense (the fastest form on MLX's CPU
    backend, whose quantized products do not use the BLAS)."""
    import mlx.core as mx

    dtype = dtype or default_dtype()
    dense = _dtype(dtype)
    meta, tensors = _read(source)
    arch = architecture(meta)
    config = arch.config(meta)
    vocab = build_vocab(meta)
    weights: dict[str, mx.array] = {}
    quantization: dict[str, dict[str, int]] = {}
    treatments: dict[str, Counter] = {}
    for t in tensors:
        kind, shape = t.type_name, t.shape
        name = arch.mlx_name(t.name)
        if name is None:  # rope_freqs: mlx-lm computes them from the scaling config
            freqs = dequantize(kind, t.data, shape)
            config["rope_scaling"] = llama3_rope_scaling(
                freqs, config["head_dim"], config["rope_theta"]
            )
            continue
        base = name.removesuffix(".weight")
        if (
            not dequantize_all
            and maps_exactly(kind)
            and name.endswith(".weight")
            and len(shape) == 2
        ):
            # scales in float16 where exact; the embedding's set the activations'
            # dtype, so on float32 they stay float32
            embedding = base == "model.embed_tokens" and dtype == "float32"
            packed = decode_affine(kind, t.data, shape, np.float32 if embedding else np.float16)
            for suffix, array in (
                ("weight", packed.weight),
                ("scales", packed.scales),
                ("biases", packed.biases),
            ):
                weights[f"{base}.{suffix}"] = mx.array(
                    np.ascontiguousarray(arch.transform(t.name, array, meta))
                )
            quantization[base] = {"group_size": 32, "bits": packed.bits}
            treatment = Treatment.PACKED
        else:
            array = arch.transform(t.name, dequantize(kind, t.data, shape), meta)
            weights[name] = mx.array(np.ascontiguousarray(array)).astype(dense)
            treatment = (
                Treatment.DENSE if kind in ("F32", "F16", "BF16", "F64") else Treatment.DEQUANTIZED
            )
        treatments.setdefault(kind, Counter())[treatment.value] += 1
    if quantization:
        bits = Counter(q["bits"] for q in quantization.values()).most_common(1)[0][0]
        config["quantization"] = {"group_size": 32, "bits": bits, **quantization}
    config["eos_token_id"] = list(vocab.eos_token_ids)
    if vocab.bos_token_id is not None:
        config["bos_token_id"] = vocab.bos_token_id

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "tokenizer.json").write_text(vocab.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps(vocab.tokenizer_config, indent=2) + "\n")
    stat = os.stat(source)
    conversion = Conversion(
        source=str(Path(source).resolve()),
        source_bytes=stat.st_size,
        source_mtime_ns=stat.st_mtime_ns,
        architecture=meta.architecture,
        model_type=config["model_type"],
        dtype=dtype,
        treatments={k: dict(v) for k, v in treatments.items()},
        bytes_held=sum(a.nbytes for a in weights.values()),
    )
    (out / MANIFEST).write_text(json.dumps(asdict(conversion), indent=2) + "\n")
    return conversion


def read_conversion(directory: str | os.PathLike) -> Conversion | None:
    """The `gguf.json` of a converted directory (None when it has none)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        return Conversion(**json.loads(path.read_text()))
    except (TypeError, ValueError):
        return None


def cache_root() -> Path:
    """Where `converted` keeps its directories: `$MLX_KVQ_CACHE`, else
    `$XDG_CACHE_HOME/mlx-kvq`, else `~/.cache/mlx-kvq`."""
    if os.environ.get("MLX_KVQ_CACHE"):
        return Path(os.environ["MLX_KVQ_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mlx-kvq"


def converted(source: str | os.PathLike, dtype: str | None = None) -> tuple[Path, Conversion, bool]:
    """(directory, conversion, whether it was converted now) for a GGUF file:
    converted once into the cache and reused while the file, the dtype and the
    converter stay the same."""
    dtype = dtype or default_dtype()
    _dtype(dtype)
    path = Path(source).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {source}")
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}:{dtype}:{CONVERTER_VERSION}"
    target = cache_root() / "gguf" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    done = read_conversion(target)
    if done is not None:
        return target, done, False
    check(path)  # refuse an unsupported file before any weight is read
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=target.parent))
    try:
        conversion = convert(path, work, dtype)
        try:
            os.replace(work, target)
        except OSError:  # another process finished first: keep theirs
            if read_conversion(target) is None:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target, conversion, True


def as_directory(model: str, dtype: str | None = None) -> tuple[str, Conversion | None, bool]:
    """`model` as what `mlx_lm.load` takes: a GGUF file becomes its converted
    directory (`converted`), anything else is returned unchanged. Returns the
    location, the conversion (None for other models) and whether it ran now."""
    if not is_gguf(model):
        return model, None, False
    directory, conversion, fresh = converted(model, dtype)
    return str(directory), conversion, fresh
