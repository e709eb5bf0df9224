"""GGUF tensors as MLX arrays: packed where a block type is MLX's affine
quantization exactly, dense otherwise.

A GGUF block of 32 weights that stores integers ``q`` with one scale and one
offset (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the 32-weight sub-blocks of Q4_K and
Q5_K) is ``w = scale * q + bias`` with MLX's group size 32: the integers are
repacked bit for bit and the scales and biases are the file's own, so nothing
is rounded again. Block types with groups of 16 (Q2_K, Q3_K, Q6_K) or
non-uniform levels (the IQ types) have no exact MLX form and are dequantized
with gguf's own numpy reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

GROUP = 32  # weights per scale in every block type that maps


class Treatment(str, Enum):
    """What the converter did with one tensor."""

    PACKED = "packed"  # repacked as MLX affine quantization, bit for bit
    DEQUANTIZED = "dequantized"  # decoded to the dense dtype
    DENSE = "dense"  # already float in the file: cast to the dense dtype


@dataclass(frozen=True)
class Packed:
    """One weight in MLX's affine layout: ``weight`` (uint32 words, the integers
    LSB first), ``scales`` and ``biases`` per group of 32 along the last axis."""

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes + self.biases.nbytes


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 fields (two bytes each on the last axis) as float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 integers: low nibbles are elements 0-15, high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit j of a little-endian bit field, for j < count, as 0/1 integers."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits[..., :count]


def _q4_0(b):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 2:18]), d, -8.0 * d


def _q4_1(b):
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q5_0(b):
    d = _f16(b[..., 0:2])
    q = _nibbles(b[..., 6:22]) | (_high_bits(b[..., 2:6], 32) << 4)
    return q, d, -16.0 * d


def _q5_1(b):
    q = _nibbles(b[..., 8:24]) | (_high_bits(b[..., 4:8], 32) << 4)
    return q, _f16(b[..., 0:2]), _f16(b[..., 2:4])


def _q8_0(b):
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:34]).view(np.int8).astype(np.int16) + 128
    return q.astype(np.uint8), d, -128.0 * d


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a K-quant super-block (12 bytes)."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 integers: each 32-byte chunk gives sub-blocks 2j (low
    nibbles) and 2j+1 (high nibbles)."""
    chunks = qs.reshape(qs.shape[:-1] + (4, 32))
    return np.stack([chunks & 0x0F, chunks >> 4], axis=-2).reshape(qs.shape[:-1] + (256,))


def _k_sub_blocks(d, dmin, scales, q):
    """(q, scale, bias) per 32-weight sub-block: w = d*sc*q - dmin*m."""
    sc, mn = _k_scales(scales)
    return q.reshape(q.shape[:-1] + (8, 32)), d[..., None] * sc, -(dmin[..., None] * mn)


def _q4_k(b):
    return _k_sub_blocks(
        _f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], _k_low_nibbles(b[..., 16:144])
    )


def _q5_k(b):
    q = _k_low_nibbles(b[..., 48:176])
    high = _high_bits(b[..., 16:48], 256).reshape(b.shape[:-1] + (32, 8))  # [l, bit]
    # bit 2j of qh[l] is element l of sub-block 2j, bit 2j+1 of sub-block 2j+1
    high = np.moveaxis(high, -1, -2).reshape(b.shape[:-1] + (256,))
    return _k_sub_blocks(_f16(b[..., 0:2]), _f16(b[..., 2:4]), b[..., 4:16], q | (high << 4))


# type name -> (bits, weights per block, bytes per block, decoder)
_AFFINE = {
    "Q4_0": (4, 32, 18, _q4_0),
    "Q4_1": (4, 32, 20, _q4_1),
    "Q5_0": (5, 32, 22, _q5_0),
    "Q5_1": (5, 32, 24, _q5_1),
    "Q8_0": (8, 32, 34, _q8_0),
    "Q4_K": (4, 256, 144, _q4_k),
    "Q5_K": (5, 256, 176, _q5_k),
}
DENSE_TYPES = ("F32", "F16", "BF16", "F64")


def maps_exactly(type_name: str) -> bool:
    """Whether a GGUF block type is MLX affine quantization (group 32) exactly."""
    return type_name in _AFFINE


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Integers in [0, 2**bits) along the last axis, packed LSB first into uint32
    words (MLX's layout for every width)."""
    if q.shape[-1] * bits % 32:
        raise ValueError(f"{q.shape[-1]} values of {bits} bits do not fill uint32 words")
    q = np.ascontiguousarray(q, np.uint8)
    if bits == 8:
        return q.view(np.uint32)
    if bits == 4:
        return np.ascontiguousarray(q[..., 0::2] | (q[..., 1::2] << 4)).view(np.uint32)
    stream = (q[..., None].astype(np.uint8) >> np.arange(bits, dtype=np.uint8)) & 1
    stream = stream.reshape(q.shape[:-1] + (-1, 8))
    packed = np.packbits(stream, axis=-1, bitorder="little").reshape(q.shape[:-1] + (-1,))
    return np.ascontiguousarray(packed).view(np.uint32)


def _in_dtype(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`x` (float32) in `dtype` when that holds every value exactly, else float32."""
    narrow = x.astype(dtype)
    return narrow if np.array_equal(narrow.astype(np.float32), x) else x


def decode_affine(
    type_name: str, raw: np.ndarray, shape: tuple[int, ...], scale_dtype=np.float16
) -> Packed:
    """A packed GGUF tensor (`raw`: uint8, one row of blocks per output row) in
    MLX's affine layout. Scales and biases are kept in `scale_dtype` where that
    represents them exactly, else in float32."""
    bits, per_block, block_bytes, decode = _AFFINE[type_name]
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if cols % per_block:
        raise ValueError(f"a row of {cols} weights is not whole {type_name} blocks")
    blocks = np.asarray(raw, np.uint8).reshape(rows, cols // per_block, block_bytes)
    q, scale, bias = decode(blocks)
    q = q.reshape(rows, cols)
    scale = scale.reshape(rows, cols // GROUP)
    bias = bias.reshape(rows, cols // GROUP)
    return Packed(
        weight=pack_bits(q, bits).reshape(*shape[:-1], -1),
        scales=_in_dtype(scale.astype(np.float32), scale_dtype).reshape(*shape[:-1], -1),
        biases=_in_dtype(bias.astype(np.float32), scale_dtype).reshape(*shape[:-1], -1),
        bits=bits,
    )


def dequantize(type_name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Any GGUF tensor as float32 of `shape`, with gguf's numpy reference."""
    if type_name == "BF16":
        words = np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16
        return words.view(np.float32).reshape(shape)
    if type_name in DENSE_TYPES:
        return np.asarray(raw).astype(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as reference

    return reference(np.asarray(raw), GGMLQuantizationType[type_name]).reshape(shape)


def affine_values(p: Packed) -> np.ndarray:
    """The weights a `Packed` stands for, as float32 (for checks)."""
    bits = p.bits
    words = np.ascontiguousarray(p.weight).view(np.uint8)
    stream = np.unpackbits(words, axis=-1, bitorder="little")
    q = stream.reshape(stream.shape[:-1] + (-1, bits)) @ (1 << np.arange(bits))
    groups = q.reshape(q.shape[:-1] + (-1, GROUP)).astype(np.float32)
    w = groups * p.scales.astype(np.float32)[..., None] + p.biases.astype(np.float32)[..., None]
    return w.reshape(q.shape)
