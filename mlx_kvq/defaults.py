"""The default KV setting, chosen from measurements (docs/quality.md).

`DEFAULT_KV_CONFIG` is the one place the server and the CLI take their
default quantized-KV setting from: keys 4 bits, values 3 bits, group size 64,
Hadamard rotation, which is 4.0 bits per stored element with scales and
biases counted (0.50 bytes against 2 for float16).

Why this one: it is the cheapest setting of the demo-model table that meets
the 4-bit quality goal (relative perplexity change at most 0.5%) with margin:
+0.085% +/- 0.126% (standard error over 16 windows of 512 tokens), mean KL
5.9e-3 nats, top-1 agreement 94.4%. K3/V3 with rotation (3.5 bits) measured
+0.415% +/- 0.169% on the same windows and +0.81% on another 8: not clear of
the goal, so it is not the default. Plain 4-bit (4.5 bits per element) is the
conservative choice: +0.05% with rotation, KL 2.7e-3.

Rotation is on because it lowered the demo model's perplexity change at every
width of 4 bits or fewer (K4/V3: +0.45% without, +0.09% with; 4-bit:
+0.16% / +0.05%; 3-bit: +0.91% / +0.42%). At 5, 6 and 8 bits the change is
within one standard error of zero either way.

Explicit bit flags (`--kv-bits 4`) mean what they mean in mlx-lm, plain
affine quantization, with no rotation unless `--kv-rotation hadamard` is
also given: a drop-in flag must not change its meaning, nor start refusing
models whose head dimension the rotation cannot handle.
Rotation needs head dimensions of the form m*2^k (m in 1, 12, 20, 28); a
model without them gets `UnsupportedKVConfig` at plan time: use
`DEFAULT_KV_CONFIG.with_(rotation="none")` for it.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import KVConfig

DEFAULT_KV_CONFIG = KVConfig(bits=4, value_bits=3, group_size=64, rotation="hadamard")


class Widths(NamedTuple):
    bits: int | None
    key_bits: int | None
    value_bits: int | None
    rotation: str
    window_bits: int | None


def resolve_widths(
    bits: int | None,
    key_bits: int | None,
    value_bits: int | None,
    rotation: str | None,
    window_bits: int | None = None,
) -> Widths:
    """The command line's bit widths and rotation, with the default setting
    filled in when none of the three bits flags was given (0 is passed on:
    callers read it as "unquantized"). `--kv-window-bits` alone keeps the
    default widths and replaces the default's window width."""
    if bits is None and key_bits is None and value_bits is None:
        d = DEFAULT_KV_CONFIG
        return Widths(
            d.bits, d.key_bits, d.value_bits, rotation or d.rotation,
            window_bits if window_bits is not None else d.window_bits,
        )  # fmt: skip
    return Widths(bits, key_bits, value_bits, rotation or "none", window_bits)
