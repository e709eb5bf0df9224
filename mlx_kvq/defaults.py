"""The default KV setting, chosen from measurements (docs/quality.md).

`DEFAULT_KV_CONFIG` is the one place the server and the CLI take their
default quantized-KV setting from: keys 4 bits, values 3 bits, Hadamard
rotation, group size 64, and 8 bits for keys and values of bounded layers
(sliding windows, chunked attention, `--max-kv-size`).

Why this one: it is what the rule of docs/quality.md (`choose_default` in
scripts/quality_tables.py) picks from the measured frontiers of both demo
models (hybrid `demo:gemma`, full-attention `demo:full`) on both texts: among
the settings at or under 4.5 bits per element held at 2,048 tokens (the bytes
of mlx-lm's `--kv-bits 4`) with top-1 agreement at least 98% and mean KL at
most 0.0015 on every model and text, the lowest worst-text mean KL. Measured (8 windows x 512 tokens per text): 4.50 bits per element,
mean KL 1.4e-4 / 8.1e-5 nats and top-1 agreement 99.5% / 99.0% on the
in-domain / out-of-domain text, where plain 4-bit at the same bytes measures
3.4e-3 / 3.9e-3 and 95.8% / 94.6%. It is the knee of the frontier: 0.44 bits
less (3-bit with wide windows) costs 2.5x the KL, 0.44 bits more (4-bit with
wide windows) buys 1.3x.

Why the bounded layers get 8 bits: on the demo model they carry nearly all
of the quantization error (4-bit everywhere: KL 3.4e-3 / 3.9e-3; the same
with 8-bit windows: 1.1e-4 / 5.6e-5), while their bytes
stop growing with the context: 8 bits there cost 0.44 bits per element at
2,048 tokens, under 0.03 at 32k. A model without bounded layers gets
K4/V3 + rotation, 4.0 bits per element: on `demo:full` (8 windows x 512
tokens) mean KL 1.7e-4 / 1.0e-4 and top-1 98.65% / 98.51% in / out of
domain, within the goal but with a thin top-1 margin; `--kv-bits 4
--kv-rotation hadamard` (4.5 bits) halves that KL there. The error did not
grow with the context on either model (docs/quality.md, at 2,048 and 1,024
tokens).

Explicit bit flags (`--kv-bits 4`) mean what they mean in mlx-lm, plain
affine quantization at that width on every layer, with no rotation and no
wider windows unless `--kv-rotation hadamard` / `--kv-window-bits N` are also
given: a drop-in flag must not change its meaning, nor start refusing
models whose head dimension the rotation cannot handle.
Rotation needs head dimensions of the form m*2^k (m in 1, 12, 20, 28); a
model without them gets `UnsupportedKVConfig` at plan time: use
`DEFAULT_KV_CONFIG.with_(rotation="none")` for it.
"""

from __future__ import annotations

from typing import NamedTuple

from .config import KVConfig

DEFAULT_KV_CONFIG = KVConfig(
    bits=4, value_bits=3, group_size=64, rotation="hadamard", window_bits=8
)


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
