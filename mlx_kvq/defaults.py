"""The default KV setting, chosen from measurements (docs/quality.md).

The server and the CLI take their default quantized-KV setting from here,
and it depends on the model's layout, decided at load from its declared
cache kinds (`plan.has_bounded_layers`):
- `DEFAULT_KV_CONFIG`, for a model with a bounded layer (sliding windows,
  chunked attention, `--max-kv-size`): the full-attention default below on
  its full-attention layers, and 8 bits per token (Hadamard rotation, groups
  of 64) for keys and values of its bounded layers, whose bytes then stay
  flat at the window (6.00 bits per element at 8,192 tokens on Gemma 3 270M);
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

The hybrid default is the rule's pick on the real Gemma 3 270M
(`python scripts/real_frontier.py --choose docs/quality_real/gemma3_*.json`,
the same texts): 98.73% / 98.78% top-1, mean KL 6.6e-4 / 7.0e-4 at 6.00
bits, where the K4/V3 + rotation per token (8-bit windows) it replaced kept
86.3% / 84.8% at 5.07 bits: on real weights the loss was in the
full-attention layers' per-token keys. The windows keep 8 bits per token:
at 4 bits they lose the most (71-72% with split full-attention layers), and
a window in the split layout holds a sawtooth of 1.34-1.77x its window's
bytes (`scripts/window_bytes.py`) where a per-token one holds a flat line.

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

DEFAULT_FULL_KV_CONFIG = KVConfig(
    key_bits=5, value_bits=4, group_size=64, rotation="hadamard", key_scales="channel",
    key_group_size=128, sinks=4, residual=128,
)  # fmt: skip
DEFAULT_KV_CONFIG = DEFAULT_FULL_KV_CONFIG.with_(window_bits=8)


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
