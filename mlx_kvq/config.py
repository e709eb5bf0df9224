"""Quantization settings as plain, validated data.

Everything here is a frozen dataclass: the numbers are checked once, when the
settings are made, so a bad `--kv-bits` fails before any model is touched.
Memory estimates are computed from these specs, never from live caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
ROTATIONS = ("none", "hadamard")
KEY_SCALES = ("token", "channel")  # what gets its own scale: each token's key, or each channel
SCALE_BYTES = 2  # scales and biases are stored as float16/bfloat16
PAGED_BLOCK_SIZE = 32  # tokens per block of the paged KV layout (`--kv-block-size`)
AUTO_BLOCK_SIZE = "auto"  # PAGED_BLOCK_SIZE, or whole key groups of the split layout


class UnsupportedKVConfig(ValueError):
    """A KV setting that cannot be honoured for some layer of the model.

    Raised at plan time (model load), never inside a forward pass. The message
    names the layer, its kind, and what to change.
    """


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor (keys or values) of a cache is stored.

    `bits=None` means full precision (the tensor's own dtype).
    `per_channel` (keys): each channel gets its own scale and bias per group
    of `group_size` tokens (KIVI) instead of each token per group of
    `group_size` channels. `sinks` and `residual`: the first `sinks` tokens
    and the last `residual` stay unquantized (the split layout, `mlx_kvq/split.py`;
    a cache's keys and values agree on them).
    """

    bits: int | None = None
    group_size: int = 64
    rotation: str = "none"
    per_channel: bool = False
    sinks: int = 0
    residual: int = 0

    def __post_init__(self) -> None:
        if self.bits is not None and self.bits not in SUPPORTED_BITS:
            raise ValueError(
                f"kv bits must be one of {SUPPORTED_BITS} (or None for no quantization), "
                f"got {self.bits}"
            )
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise ValueError(
                f"kv group size must be one of {SUPPORTED_GROUP_SIZES}, got {self.group_size}"
            )
        if self.rotation not in ROTATIONS:
            raise ValueError(f"kv rotation must be one of {ROTATIONS}, got {self.rotation!r}")
        if self.sinks < 0 or self.residual < 0:
            raise ValueError(
                f"kv sinks and residual must be >= 0, got {self.sinks} and {self.residual}"
            )

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def split(self) -> bool:
        """Stored in the split layout: unquantized sinks or residual, or per-channel keys."""
        return self.quantized and (self.per_channel or self.sinks > 0 or self.residual > 0)

    @property
    def flush_unit(self) -> int:
        """Tokens quantized at once in the split layout: a whole group for
        per-channel scales, one token otherwise."""
        return self.group_size if self.per_channel else 1

    def bytes_per_element(self, dtype_bytes: int = 2) -> float:
        """Bytes one stored element costs, scales and biases included."""
        if self.bits is None:
            return float(dtype_bytes)
        return self.bits / 8 + 2 * SCALE_BYTES / self.group_size

    def check_dim(self, dim: int, where: str = "") -> None:
        """Refuse a head dimension this spec cannot pack (per-channel scales
        group tokens, any head dimension packs)."""
        if self.bits is None or self.per_channel:
            return
        at = f" at {where}" if where else ""
        if dim % self.group_size:
            fits = [g for g in SUPPORTED_GROUP_SIZES if dim % g == 0]
            fix = (
                f"use --kv-group-size {max(fits)}"
                if fits
                else "no supported group size divides it: leave the layer unquantized "
                "(--allow-partial-kv --kv-skip-layers)"
            )
            raise UnsupportedKVConfig(
                f"head dimension {dim}{at} is not divisible by kv group size {self.group_size}; {fix}"
            )
        if (dim * self.bits) % 32:
            raise UnsupportedKVConfig(
                f"head dimension {dim}{at} cannot be packed at {self.bits} bits "
                f"(dim * bits must be a multiple of 32)"
            )

    def describe(self) -> str:
        """`4b/g64` (groups of 64 channels per token), `4b/c128` (groups of 128
        tokens per channel), `+rot` with rotation."""
        if self.bits is None:
            return "fp16"
        rot = "+rot" if self.rotation != "none" else ""
        return f"{self.bits}b/{'c' if self.per_channel else 'g'}{self.group_size}{rot}"


def is_split(key_spec: QuantSpec, value_spec: QuantSpec) -> bool:
    """Whether a layer of these specs is stored in the split layout: either
    spec is (`QuantSpec.split`); the one rule every layout reads."""
    return key_spec.split or value_spec.split


@dataclass(frozen=True)
class KVConfig:
    """Everything the user asked of the KV cache, in mlx-lm's vocabulary.

    `bits` is `--kv-bits`; `key_bits`/`value_bits` override it per tensor
    (None: take `bits`; 0: that tensor unquantized).
    `window_bits` (`--kv-window-bits`) gives keys and values of *bounded*
    layers (sliding windows, chunked attention, full attention bounded by
    `--max-kv-size`) their own width: their bytes stop growing with the
    context, so extra precision there costs a fixed amount. None: the same
    widths as every other layer; 0: bounded layers unquantized.
    `quantized_start` is `--quantized-kv-start`: caches hold full precision
    until they reach that many tokens, then convert in place.
    `key_scales` (`--kv-key-scales`): "token" (each token's key in groups of
    `group_size` channels, as mlx-lm) or "channel" (each channel in groups of
    `key_group_size` tokens, KIVI); `key_group_size` (default `group_size`)
    is the keys' group size either way. `sinks` (`--kv-sinks`) and
    `residual` (`--kv-residual`): the first `sinks` tokens (full-attention
    layers) and the last `residual` tokens (every layer) stay unquantized,
    held in 16 bits (`mlx_kvq/split.py`).
    """

    bits: int | None = None
    group_size: int = 64
    key_bits: int | None = None
    value_bits: int | None = None
    rotation: str = "none"
    quantized_start: int = 0
    max_kv_size: int | None = None
    allow_partial: bool = False
    skip_layers: tuple[int, ...] = field(default_factory=tuple)
    window_bits: int | None = None
    key_scales: str = "token"
    key_group_size: int | None = None
    residual: int = 0
    sinks: int = 0

    def __post_init__(self) -> None:
        if self.key_scales not in KEY_SCALES:
            raise ValueError(f"kv key scales must be one of {KEY_SCALES}, got {self.key_scales!r}")
        # Building the specs validates bits, group size and rotation.
        self.key_spec  # noqa: B018
        self.value_spec  # noqa: B018
        if self.window_bits is not None:
            QuantSpec(self.window_bits or None, self.group_size)
            if not self.enabled:
                raise ValueError(
                    "--kv-window-bits sets the width of bounded layers of a quantized cache: "
                    "give --kv-bits (or --kv-key-bits / --kv-value-bits) too"
                )
            if self.window_bits == 0 and not self.allow_partial:
                raise ValueError(
                    "--kv-window-bits 0 leaves bounded layers unquantized: pass "
                    "--allow-partial-kv together with it"
                )
        if (self.residual or self.sinks or self.key_scales != "token") and not self.enabled:
            raise ValueError(
                "--kv-residual, --kv-sinks and --kv-key-scales shape a quantized cache: "
                "give --kv-bits (or --kv-key-bits / --kv-value-bits) too"
            )
        if self.key_scales == "channel" and not self.key_spec.quantized:
            raise ValueError("--kv-key-scales channel needs quantized keys (--kv-key-bits)")
        if self.quantized_start < 0:
            raise ValueError(f"quantized kv start must be >= 0, got {self.quantized_start}")
        if self.max_kv_size is not None and self.max_kv_size < 1:
            raise ValueError(f"max kv size must be positive, got {self.max_kv_size}")
        if self.skip_layers and not self.allow_partial:
            raise ValueError(
                "skipping layers leaves them unquantized: pass --allow-partial-kv "
                "together with --kv-skip-layers"
            )
        object.__setattr__(self, "skip_layers", tuple(sorted(set(self.skip_layers))))

    def _spec(self, bits: int | None, group: int, per_channel: bool, sinks: int) -> QuantSpec:
        if not bits:
            return QuantSpec(None, group)
        return QuantSpec(bits, group, self.rotation, per_channel, sinks, self.residual)

    @property
    def key_spec(self) -> QuantSpec:
        bits = self.key_bits if self.key_bits is not None else self.bits
        group = self.key_group_size or self.group_size
        return self._spec(bits, group, self.key_scales == "channel", self.sinks)

    @property
    def value_spec(self) -> QuantSpec:
        bits = self.value_bits if self.value_bits is not None else self.bits
        return self._spec(bits, self.group_size, False, self.sinks)

    @property
    def enabled(self) -> bool:
        return self.key_spec.quantized or self.value_spec.quantized

    def specs(self, bounded: bool = False) -> tuple[QuantSpec, QuantSpec]:
        """(key spec, value spec) of one layer. `bounded` layers (a window of
        tokens: sliding, chunked, `--max-kv-size`) keep no sinks of their own
        (their queries do not see the first tokens; a `--max-kv-size` window
        keeps mlx-lm's own); with `window_bits` set they take that width per
        token, nothing kept exact (their bytes stop growing with the context)."""
        if not bounded:
            return self.key_spec, self.value_spec
        if self.window_bits is None:
            k, v = self.key_spec, self.value_spec
            return replace(k, sinks=0), replace(v, sinks=0)
        bits = self.window_bits
        spec = QuantSpec(bits or None, self.group_size, self.rotation if bits else "none")
        return spec, spec

    def with_(self, **changes) -> KVConfig:
        return replace(self, **changes)

    def describe(self) -> str:
        if not self.enabled:
            return "unquantized"
        k, v = self.key_spec, self.value_spec
        text = f"K {k.describe()} V {v.describe()}"
        if self.window_bits is not None:
            text += f", windows {self.specs(bounded=True)[0].describe()}"
        if self.sinks:
            text += f", {self.sinks} sinks"
        if self.residual:
            text += f", last {self.residual} exact"
        if self.quantized_start:
            text += f", from token {self.quantized_start}"
        return text

    def as_kwargs(self) -> dict:
        """The setting as the keyword arguments `from_args` (and mlx-lm's
        generation functions, with ours added) take: its exact inverse."""
        return {
            "kv_bits": self.bits, "kv_group_size": self.group_size,
            "kv_key_bits": self.key_bits, "kv_value_bits": self.value_bits,
            "kv_rotation": self.rotation, "quantized_kv_start": self.quantized_start,
            "max_kv_size": self.max_kv_size, "allow_partial_kv": self.allow_partial,
            "kv_skip_layers": self.skip_layers, "kv_window_bits": self.window_bits,
            "kv_key_scales": self.key_scales, "kv_key_group_size": self.key_group_size,
            "kv_residual": self.residual, "kv_sinks": self.sinks,
        }  # fmt: skip

    @classmethod
    def from_args(
        cls,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kv_key_bits: int | None = None,
        kv_value_bits: int | None = None,
        kv_rotation: str = "none",
        quantized_kv_start: int = 0,
        max_kv_size: int | None = None,
        allow_partial_kv: bool = False,
        kv_skip_layers: tuple[int, ...] | list[int] | None = None,
        kv_window_bits: int | None = None,
        kv_key_scales: str | None = None,
        kv_key_group_size: int | None = None,
        kv_residual: int | None = None,
        kv_sinks: int | None = None,
    ) -> KVConfig:
        """Build from mlx-lm style keyword names (the CLI flag names)."""
        return cls(
            bits=kv_bits or None,
            group_size=kv_group_size,
            key_bits=kv_key_bits,
            value_bits=kv_value_bits,
            rotation=kv_rotation or "none",
            quantized_start=quantized_kv_start or 0,
            max_kv_size=max_kv_size,
            allow_partial=allow_partial_kv,
            skip_layers=tuple(kv_skip_layers or ()),
            window_bits=kv_window_bits,
            key_scales=kv_key_scales or "token",
            key_group_size=kv_key_group_size,
            residual=kv_residual or 0,
            sinks=kv_sinks or 0,
        )
