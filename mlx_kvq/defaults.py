"""The default KV setting, chosen from measurements (docs/quality.md).

The server and the CLI take their default quantized-KV setting from here,
and it depends on the model's layout, decided at load from its declared
cache kinds (`plan.has_bounded_layers`):
- `DEFAULT_KV_CONFIG`, for a model with a bounded layer (sliding windows,
  chunked attention, `--max-kv-size`): keys 4 bits, values 3 bits, Hadamard
  rotation, group size 64, and 8 bits for keys and values of bounded layers
  (4.5 bits per element at 2,048 tokens, the bytes of mlx-lm's `--kv-bits 4`);
- `DEFAULT_FULL_KV_CONFIG`, for a model whose layers all hold the whole
  context: the split layout, keys 5 bits per channel in groups of 128 tokens,
  values 4 bits per token in groups of 64 channels, Hadamard rotation, the
  first 4 tokens and the last 128 exact (5.22 bits per element at 8,192
  tokens). Kinds with no split form (indexer models, deepseek_v41's layer
  fields) get the same widths per token, and the plan says so per layer.

Why these: each is what the rule of docs/quality.md (`choose_default` in
scripts/quality_tables.py) picks from measured settings. The goal: top-1
agreement at least 98% and mean KL at most 0.0015 on both texts, within 4.5
bits per element; among those that meet it, the lowest worst-text mean KL.
Where nothing within the budget meets it, quality comes first: the cheapest
setting that meets it with every text's top-1 a standard error clear of 98%.

The full-attention default is the rule's pick on the real SmolLM2-135M
(`python scripts/real_frontier.py --choose docs/quality_real/smollm2_*.json`;
2 x 1,024 tokens of the GPL-3 and of Python stdlib code): 99.07% / 99.22%
top-1, mean KL 4.5e-4 / 3.9e-4, where the per-token K6/V5 + rotation it
replaced kept 94.97% at 6.0 bits and mlx-lm's `--kv-bits 4` 74.9% / 81.1%.

The hybrid default is still the rule's pick on the hybrid demo model
(`demo:gemma`, 8 windows x 512 tokens per text: mean KL 1.4e-4 / 8.1e-5,
top-1 99.5% / 99.0%). On the real Gemma 3 270M it keeps 86.3% / 84.8% at
5.07 bits; the rule there picks K6/V5 split with the last 64 exact (6.60
bits: 98.39% / 98.73%), which is not switched yet: a split window's bytes are
a bounded sawtooth rather than flat, and the scripted test models hold 9 of
11 scripts under it (docs/quality.md).

Why the bounded layers get 8 bits: on the hybrid demo model they carry
nearly all of the quantization error (4-bit everywhere: KL 3.4e-3 / 3.9e-3;
the same with 8-bit windows: 1.1e-4 / 5.6e-5), while their bytes stop
growing with the context: 8 bits there cost 0.44 bits per element at 2,048
tokens, under 0.03 at 32k.

Explicit bit flags (`--kv-bits 4`) mean what they mean in mlx-lm, plain
affine quantization at that width on every layer, with no rotation and no
wider windows unless `--kv-rotation hadamard` / `--kv-window-bits N` are also
given: a drop-in flag must not change its meaning, nor start refusing
models whose head dimension the rotation cannot handle.
Rotation needs head dimensions of the form m*2^k (m in 1, 12, 20, 28); a
model without them gets `UnsupportedKVConfig` at plan time: pass
`--kv-rotation none` (the default's widths without rotation).
"""

from __future__ import annotations

from typing import NamedTuple

from .config import KVConfig

DEFAULT_KV_CONFIG = KVConfig(
    bits=4, value_bits=3, group_size=64, rotation="hadamard", window_bits=8
)
DEFAULT_FULL_KV_CONFIG = KVConfig(
    key_bits=5, value_bits=4, group_size=64, rotation="hadamard", key_scales="channel",
    key_group_size=128, sinks=4, residual=128,
)  # fmt: skip


def default_kv_config(bounded: bool) -> KVConfig:
    """The default setting of a model with a bounded layer (`bounded`) or of
    one whose layers all hold the whole context."""
    return DEFAULT_KV_CONFIG if bounded else DEFAULT_FULL_KV_CONFIG


def default_name(bounded: bool) -> str:
    """Which default a model gets, in words (as `mlx-kvq plan` reports it)."""
    if bounded:
        return "DEFAULT_KV_CONFIG, the default for models with a bounded layer"
    return "DEFAULT_FULL_KV_CONFIG, the default for models whose layers all hold the whole context"


class Widths(NamedTuple):
    bits: int | None
    key_bits: int | None
    value_bits: int | None
    rotation: str
    window_bits: int | None
    key_scales: str = "token"
    key_group_size: int | None = None
    residual: int = 0
    sinks: int = 0


def asks_for_default(bits: int | None, key_bits: int | None, value_bits: int | None) -> bool:
    """No bits flag given: the default setting applies."""
    return bits is None and key_bits is None and value_bits is None


def resolve_widths(
    bits: int | None,
    key_bits: int | None,
    value_bits: int | None,
    rotation: str | None,
    window_bits: int | None = None,
    bounded: bool = True,
    key_scales: str | None = None,
    key_group_size: int | None = None,
    residual: int | None = None,
    sinks: int | None = None,
) -> Widths:
    """The command line's bit widths, rotation and layout (key scales, key
    group size, residual, sinks), with the default setting of the model's
    layout (`bounded`: some layer keeps a window) filled in when none of the
    three bits flags was given (0 is passed on: callers read it as
    "unquantized"). A layout flag given alone keeps the default's widths and
    replaces that part of it. With explicit bits, what is not given means
    what it means in mlx-lm: no rotation, per-token keys, nothing exact."""

    def given(value, fallback):
        return value if value is not None else fallback

    if asks_for_default(bits, key_bits, value_bits):
        d = default_kv_config(bounded)
        return Widths(
            d.bits, d.key_bits, d.value_bits, rotation or d.rotation,
            given(window_bits, d.window_bits), given(key_scales, d.key_scales),
            given(key_group_size, d.key_group_size), given(residual, d.residual),
            given(sinks, d.sinks),
        )  # fmt: skip
    return Widths(
        bits, key_bits, value_bits, rotation or "none", window_bits, key_scales or "token",
        key_group_size, residual or 0, sinks or 0,
    )  # fmt: skip
