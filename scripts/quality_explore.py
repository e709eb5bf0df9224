"""Measure KV quantization schemes before building them (fake quantization).

    python scripts/quality_explore.py                 # every scheme, 4 windows per text
    python scripts/quality_explore.py --windows 8 --only per-channel
    python scripts/quality_explore.py --render        # the table from docs/quality_explore.json
    python scripts/quality_explore.py --model demo:full   # the full-attention demo model

Which storage schemes are worth a real cache layout? This script answers it
cheaply on the demo model and its two texts: each layer's cache keeps the
exact K/V and hands attention a *fake-quantized* copy (quantized, then
dequantized in float32), so a scheme is a few lines here instead of a cache
layout for every kind. Schemes (per layer kind, sliding or full):

- per-token affine quantization along the head dimension in groups of `g`
  (what `mx.quantize` and the package's caches do), optionally after a
  Hadamard rotation, for keys and values separately;
- per-channel key quantization (KIVI): keys quantized along the tokens, in
  groups of `G` tokens per channel; the tokens of a group not yet complete
  stay in full precision (KIVI) or, with `partial`, are quantized as they
  are (isolating the effect of the grouping from that of the full-precision
  tail);
- a full-precision window of the `R` most recent tokens (KIVI's residual).

Every layer keeps its whole history (a sliding layer's window is applied by
its mask, as mlx-lm's `KVCache.make_mask(window_size=...)` does), so the
model computes what it computes with the real caches; per-token schemes
quantize each token once, when it arrives, exactly as the package's caches
do (4-bit: KL 3.34e-3 here against 3.37e-3 through the real caches on the
same 16 windows of docs/quality.md's first table). Results go to
docs/quality_explore.json and between `<!-- BEGIN explore -->` markers in
docs/quality.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_kvq.blas import use_fast_blas  # noqa: E402
from mlx_kvq.evaluate import cut_windows, load_eval_inputs  # noqa: E402

DOC = REPO / "docs" / "quality.md"
RAW = REPO / "docs" / "quality_explore.json"
FP = {"kb": None, "vb": None}


def _s(kb, vb, kg=64, vg=64, **kw) -> dict:
    return {"kb": kb, "vb": vb, "kg": kg, "vg": vg, **kw}


# name -> (group, description, {"sliding": scheme, "full": scheme} or one scheme for both)
SCHEMES: dict[str, tuple[str, dict]] = {
    "4-bit": ("baseline", _s(4, 4)),
    "4-bit, full layers only": ("layer kind", {"sliding": FP, "full": _s(4, 4)}),
    "4-bit, sliding layers only": ("layer kind", {"sliding": _s(4, 4), "full": FP}),
    "4-bit, layer 0 only": ("layer kind", {"layers": [0], **_s(4, 4)}),
    "4-bit, layer 4 only": ("layer kind", {"layers": [4], **_s(4, 4)}),
    "K4, values exact": ("keys", _s(4, None)),
    "K4 + rot, values exact": ("keys", _s(4, None, krot=True)),
    "K4 g32, values exact": ("keys", _s(4, None, kg=32)),
    "K4 per-channel G32, values exact": ("keys", _s(4, None, kg=32, kmode="channel")),
    "K4 per-channel G128, values exact": ("keys", _s(4, None, kg=128, kmode="channel")),
    "K4 per-channel G32 + rot, values exact": (
        "keys",
        _s(4, None, kg=32, kmode="channel", krot=True),
    ),
    "V4, keys exact": ("values", _s(None, 4)),
    "V4 g32, keys exact": ("values", _s(None, 4, vg=32)),
    "V4 + rot, keys exact": ("values", _s(None, 4, vrot=True)),
    "4-bit, last 32 tokens exact": ("residual", _s(4, 4, R=32)),
    "4-bit, last 128 tokens exact": ("residual", _s(4, 4, R=128)),
    "sliding 8-bit, full 4-bit": ("per kind", {"sliding": _s(8, 8), "full": _s(4, 4)}),
    "sliding 6-bit, full 4-bit": ("per kind", {"sliding": _s(6, 6), "full": _s(4, 4)}),
    "sliding 5-bit, full 4-bit": ("per kind", {"sliding": _s(5, 5), "full": _s(4, 4)}),
    "sliding 8-bit, full K4/V3 + rot": (
        "per kind",
        {"sliding": _s(8, 8), "full": _s(4, 3, krot=True, vrot=True)},
    ),
    "sliding 8-bit, full K4/V3 + keys rot": (
        "per kind",
        {"sliding": _s(8, 8), "full": _s(4, 3, krot=True)},
    ),
    "sliding 8-bit, full 3-bit": ("per kind", {"sliding": _s(8, 8), "full": _s(3, 3)}),
    "sliding 8-bit, full 3-bit + keys rot": (
        "per kind",
        {"sliding": _s(8, 8), "full": _s(3, 3, krot=True)},
    ),
    "sliding 8-bit, full K3 per-channel G128 (partial groups quantized) / V3": (
        "per-channel",
        {"sliding": _s(8, 8), "full": _s(3, 3, kg=128, kmode="channel", partial=True)},
    ),
    "sliding 8-bit, full K3 per-channel G128 (partial group exact) / V3": (
        "per-channel",
        {"sliding": _s(8, 8), "full": _s(3, 3, kg=128, kmode="channel")},
    ),
    "sliding 8-bit, full 3-bit + keys rot, last 64 tokens exact": (
        "residual",
        {"sliding": _s(8, 8), "full": _s(3, 3, krot=True, R=64)},
    ),
    "sliding 8-bit, full 2-bit + rot": (
        "per kind",
        {"sliding": _s(8, 8), "full": _s(2, 2, krot=True, vrot=True)},
    ),
    "sliding 8-bit, full K2 per-channel G128 (partial groups quantized) / V2": (
        "per-channel",
        {"sliding": _s(8, 8), "full": _s(2, 2, kg=128, kmode="channel", partial=True)},
    ),
    # Can per-channel keys or an exact residual reach 3.5 bits per element with
    # top-1 >= 98% and mean KL <= 0.002 (on both demo models)?
    "sliding 6-bit, full K3/V2 + keys rot": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(3, 2, krot=True)},
    ),
    "sliding 6-bit, full K3/V2 + rot": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(3, 2, krot=True, vrot=True)},
    ),
    "sliding 8-bit, full K3 per-channel G128 (partial groups quantized) / V2": (
        "3.5 bits",
        {"sliding": _s(8, 8), "full": _s(3, 2, kg=128, kmode="channel", partial=True)},
    ),
    "sliding 6-bit, full K3/V3 + keys rot": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(3, 3, krot=True)},
    ),
    "sliding 6-bit, full K3 per-channel G128 (partial groups quantized) / V3": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(3, 3, kg=128, kmode="channel", partial=True)},
    ),
    "sliding 6-bit, full K4 per-channel G128 (partial groups quantized) / V2": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(4, 2, kg=128, kmode="channel", partial=True)},
    ),
    "sliding 6-bit, full K3/V3 + keys rot, last 16 tokens exact": (
        "3.5 bits",
        {"sliding": _s(6, 6), "full": _s(3, 3, krot=True, R=16)},
    ),
}

# The real models (SmolLM2-135M, Gemma 3 270M): each lever on its own, keys
# first (values exact), then keys and values together. `S`: the first S tokens
# exact (attention sinks); `R`: the last R exact (residual); `x16`: the exact
# parts held in 16 bits (float16), as a real layout holds them; `prerope`: keys
# quantized before RoPE (KVQuant); `kout`: that many key channels per head
# exact, the largest of each group of tokens (outliers kept apart); `tail8` /
# `tailfp8`: the exact parts held at 8 bits per token (g64) / as fp8 (e4m3,
# scaled per 64 channels) instead; `nuq`: non-uniform levels (`nuq_levels`).
_K = {"vb": None}
REAL_SCHEMES: dict[str, tuple[str, dict]] = {
    "K8, values exact": ("real keys", _s(8, None)),
    "K4, values exact": ("real keys", _s(4, None)),
    "K4 + rot, values exact": ("real keys", _s(4, None, krot=True)),
    "K4, 4 sinks exact, values exact": ("real keys", _s(4, None, S=4)),
    "K4, last 128 exact, values exact": ("real keys", _s(4, None, R=128)),
    "K4 per-channel G32, values exact": ("real keys", _s(4, None, kg=32, kmode="channel")),
    "K4 per-channel G128, values exact": ("real keys", _s(4, None, kg=128, kmode="channel")),
    "K4 per-channel G128 + rot, values exact": (
        "real keys", _s(4, None, kg=128, kmode="channel", krot=True)),
    "K4 per-channel G128, 4 sinks, values exact": (
        "real keys", _s(4, None, kg=128, kmode="channel", S=4)),
    "K4 per-channel G128 pre-RoPE, values exact": (
        "real keys", _s(4, None, kg=128, kmode="channel", prerope=True)),
    "K4 4 outlier channels exact, values exact": ("real keys", _s(4, None, kout=4)),
    "K3 per-channel G128, 4 sinks, values exact": (
        "real keys", _s(3, None, kg=128, kmode="channel", S=4)),
    "K2 per-channel G128, 4 sinks, values exact": (
        "real keys", _s(2, None, kg=128, kmode="channel", S=4)),
    "V4, keys exact": ("real values", _s(None, 4)),
    "V3, keys exact": ("real values", _s(None, 3)),
    "V2, keys exact": ("real values", _s(None, 2)),
    "V4 + rot, keys exact": ("real values 2", _s(None, 4, vrot=True)),
    "V4 g32, keys exact": ("real values 2", _s(None, 4, vg=32)),
    "V4, 4 sinks, keys exact": ("real values 2", _s(None, 4, S=4)),
    "V4, last 128 exact, keys exact": ("real values 2", _s(None, 4, R=128)),
    "V5, keys exact": ("real values 2", _s(None, 5)),
    "V4 + rot, 4 sinks, last 64, keys exact": ("real values 2", _s(None, 4, vrot=True, S=4, R=64)),
    "K4 per-channel G32 + rot, 4 sinks, last 64, values exact": (
        "real keys 2", _s(4, None, kg=32, kmode="channel", krot=True, S=4, R=64)),
    "K4 per-channel G128, 4 sinks, last 64, values exact": (
        "real keys 2", _s(4, None, kg=128, kmode="channel", S=4, R=64)),
    "K4 ch G128 / V4, 4 sinks, 16-bit exact": (
        "real", _s(4, 4, kg=128, kmode="channel", S=4, x16=True)),
    "K4 ch G128 / V4, 4 sinks, last 64, 16-bit exact": (
        "real", _s(4, 4, kg=128, kmode="channel", S=4, R=64, x16=True)),
    "K4 ch G128 / V3, 4 sinks, last 128, 16-bit exact": (
        "real", _s(4, 3, kg=128, kmode="channel", S=4, R=128, x16=True)),
    "K3 ch G128 / V3, 4 sinks, last 128, 16-bit exact": (
        "real", _s(3, 3, kg=128, kmode="channel", S=4, R=128, x16=True)),
    # Gemma 3 (15 sliding layers of 512, 3 full; head_dim 256): per layer kind
    "gemma: windows 8-bit, full K4 ch G128 / V4 g128, 4 sinks, last 64, 16-bit exact": (
        "gemma", {"sliding": _s(8, 8, kg=128, vg=128),
                  "full": _s(4, 4, kg=128, vg=128, kmode="channel", S=4, R=64, x16=True)}),
    "gemma: windows 4-bit g128, full K4 ch G128 / V4 g128, 4 sinks, last 64, 16-bit exact": (
        "gemma", {"sliding": _s(4, 4, kg=128, vg=128),
                  "full": _s(4, 4, kg=128, vg=128, kmode="channel", S=4, R=64, x16=True)}),
    "gemma: windows K4 ch G32 / V4 g128, 16-bit exact, full K4 ch G128 / V4 g128, 4 sinks, last 64": (
        "gemma", {"sliding": _s(4, 4, kg=32, vg=128, kmode="channel", x16=True),
                  "full": _s(4, 4, kg=128, vg=128, kmode="channel", S=4, R=64, x16=True)}),
    "gemma: windows 8-bit, full 4-bit g128 + rot": (
        "gemma", {"sliding": _s(8, 8, kg=128, vg=128),
                  "full": _s(4, 4, kg=128, vg=128, krot=True, vrot=True)}),
    "gemma: windows 4-bit g128 + rot, full exact": (
        "gemma", {"sliding": _s(4, 4, kg=128, vg=128, krot=True, vrot=True), "full": FP}),
    # per-token window keys with a fixed per-channel basis (values and full layers exact)
    "gemma keys: windows K4 g64": ("gemma keys", {"sliding": _s(4, None), "full": FP}),
    "gemma keys: windows K4 g64 + rot": (
        "gemma keys", {"sliding": _s(4, None, krot=True), "full": FP}),
    "gemma keys: windows K4 g64, scaled by k_norm": (
        "gemma keys", {"sliding": _s(4, None, kbasis="knorm"), "full": FP}),
    "gemma keys: windows K4 g64 + rot, scaled by k_norm": (
        "gemma keys", {"sliding": _s(4, None, kbasis="knorm", krot=True), "full": FP}),
    "gemma keys: windows K4 g64, scaled by first chunk's max": (
        "gemma keys", {"sliding": _s(4, None, kbasis="absmax"), "full": FP}),
    "gemma keys: windows K4 g64 + rot, scaled by first chunk's max": (
        "gemma keys", {"sliding": _s(4, None, kbasis="absmax", krot=True), "full": FP}),
    "gemma keys: windows K4 g64, less first chunk's mean": (
        "gemma keys", {"sliding": _s(4, None, kbasis="mean"), "full": FP}),
    "gemma keys: windows K4 g64 + rot, less first chunk's mean": (
        "gemma keys", {"sliding": _s(4, None, kbasis="mean", krot=True), "full": FP}),
    "gemma keys: windows K4 ch G128, 16-bit exact": (
        "gemma keys", {"sliding": _s(4, None, kg=128, kmode="channel", x16=True), "full": FP}),
    # every window per token at other widths (rotated), full layers exact or K4/V3 split;
    # `tail8`: the exact tail held at 8 bits per token (g64, rotated as the body)
    **{
        f"gemma windows: K{kb}/V{vb} g{g} + rot{f', last {r} at 8-bit' if r else ''}, full {fn}": (
            "gemma windows", {"sliding": _s(kb, vb, kg=g, vg=g, krot=True, vrot=True, R=r, tail8=True),
                              "full": full})
        for kb, vb, g, r in ((5, 5, 64, 0), (5, 5, 128, 0), (6, 6, 128, 0), (6, 4, 64, 0),
                             (4, 4, 64, 64), (4, 4, 64, 32), (4, 3, 64, 64), (5, 5, 128, 32))
        for fn, full in (("exact", FP),
                         ("K4/V3 ch G128 + rot, 4 sinks, last 128",
                          _s(4, 3, kg=128, kmode="channel", krot=True, vrot=True, S=4, R=128,
                             x16=True)))
    },
    # windows' keys per channel with the tail (partial group and last R) at 8 bits per token
    **{
        f"gemma windows ch: K{kb} ch G{g} / V{vb} g64, last {r} + partial group at {x}, full exact": (
            "gemma windows ch", {"sliding": _s(kb, vb, kg=g, kmode="channel", R=r,
                                               **({"tail8": True} if x == "8-bit" else {"x16": True})),
                                 "full": FP})
        for kb, vb, g, r, x in ((4, 4, 128, 0, "8-bit"), (4, 4, 128, 64, "8-bit"),
                                (4, 4, 128, 128, "8-bit"), (4, 4, 64, 64, "8-bit"),
                                (4, 4, 32, 32, "8-bit"), (4, 4, 128, 64, "16-bit"),
                                (4, 3, 128, 128, "8-bit"), (5, 4, 128, 64, "8-bit"))
    },
    # both kinds with their tails at 8 bits per token (full layers: 4 sinks too)
    **{
        f"gemma tail8: windows K{wk}/V{wv} ch G128 last {wr}, full K{fk}/V{fv} ch G128{' + rot' if rot else ''} last {fr}": (
            "gemma tail8", {"sliding": _s(wk, wv, kg=128, kmode="channel", R=wr, tail8=True),
                            "full": _s(fk, fv, kg=128, kmode="channel", krot=rot, vrot=rot, S=4,
                                       R=fr, tail8=True)})
        for wk, wv, wr, fk, fv, fr, rot in ((5, 4, 64, 4, 3, 128, True), (5, 4, 64, 4, 3, 128, False),
                                             (5, 5, 64, 4, 3, 128, False), (6, 4, 64, 4, 3, 128, False),
                                             (5, 4, 32, 4, 3, 128, False), (5, 4, 64, 4, 3, 64, False),
                                             (5, 4, 64, 4, 4, 128, False), (6, 5, 64, 4, 3, 64, False))
    },
    **{
        f"tail8: K{kb}/V{vb} ch G128 + rot, 4 sinks, last {r} at {x}": (
            "real tail8", _s(kb, vb, kg=128, kmode="channel", krot=True, vrot=True, S=4, R=r,
                             **({"tail8": True} if x == "8-bit" else {"x16": True})))
        for kb, vb, r, x in ((4, 4, 128, "8-bit"), (4, 4, 128, "16-bit"), (4, 3, 128, "8-bit"),
                             (4, 4, 64, "8-bit"), (5, 3, 128, "8-bit"))
    },
    # the tail held as fp8 (e4m3) scaled per 64 channels
    "fp8 tail: K4/V4 ch G128 + rot, 4 sinks, last 128": (
        "real fp8", _s(4, 4, kg=128, kmode="channel", krot=True, vrot=True, S=4, R=128, tailfp8=True)),
    "fp8 tail: K4/V3 ch G128 + rot, 4 sinks, last 128": (
        "real fp8", _s(4, 3, kg=128, kmode="channel", krot=True, vrot=True, S=4, R=128, tailfp8=True)),
    "fp8 tail: K4/V4 ch G128, 4 sinks, last 128": (
        "real fp8", _s(4, 4, kg=128, kmode="channel", S=4, R=128, tailfp8=True)),
    **{
        f"gemma fp8 tail: windows K{wk}/V{wv} ch G128 last {wr}, full K4/V3 ch G128 last {fr}": (
            "gemma fp8", {"sliding": _s(wk, wv, kg=128, kmode="channel", R=wr, tailfp8=True),
                          "full": _s(4, 3, kg=128, kmode="channel", S=4, R=fr, tailfp8=True)})
        for wk, wv, wr, fr in ((6, 4, 64, 128), (5, 4, 64, 128), (4, 4, 64, 128), (5, 5, 64, 128))
    },
    **{
        f"gemma best: windows K{wk}/V{wv} ch G128 last 64 at 8-bit, full K4/V3 ch G128, 4 sinks, last 128 at {x}": (
            "gemma best", {"sliding": _s(wk, wv, kg=128, kmode="channel", R=64, tail8=True),
                           "full": _s(4, 3, kg=128, kmode="channel", S=4, R=128,
                                      **({"tail8": True} if x == "8-bit" else {"x16": True}))})
        for wk, wv, x in ((6, 4, "8-bit"), (6, 4, "16-bit"), (6, 5, "8-bit"))
    },
    "gemma best nuq: windows K6/V4 ch G128 last 64 at 8-bit, full K4/V3 ch G128, 4 sinks, last 128 at 8-bit, levels eps 0.06": (
        "gemma best nuq", {"sliding": _s(6, 4, kg=128, kmode="channel", R=64, tail8=True, nuq=0.06),
                           "full": _s(4, 3, kg=128, kmode="channel", S=4, R=128, tail8=True, nuq=0.06)}),
    # non-uniform levels (normal quantiles between eps and 1 - eps) in every group
    **{
        f"nuq: K4/V3 ch G128 + rot, 4 sinks, last 128, 16-bit exact, eps {e}": (
            "real nuq", _s(4, 3, kg=128, kmode="channel", krot=True, vrot=True, S=4, R=128,
                           x16=True, nuq=e))
        for e in (None, 0.06, 0.1)
    },
    **{
        f"gemma nuq: K4/V4 ch G128, 4 sinks, last 64, 16-bit exact, eps {e}": (
            "gemma nuq", _s(4, 4, kg=128, kmode="channel", S=4, R=64, x16=True, nuq=e))
        for e in (None, 0.06, 0.1)
    },
    # the windows' per-channel keys quantized before RoPE (KVQuant)
    **{
        f"gemma prerope: windows K4 ch G128{' pre-RoPE' if pre else ''} / V4 g64, last 64, 16-bit exact, full exact": (
            "gemma prerope", {"sliding": _s(4, 4, kg=128, kmode="channel", R=64, x16=True,
                                            prerope=pre), "full": FP})
        for pre in (False, True)
    },
    # one sliding layer of Gemma 3 270M at a time (layers 5, 11, 17 are full attention)
    **{
        f"gemma layer {i}: K4/V4 g64 + rot, every other layer exact": (
            "gemma layer", {"layers": [i], **_s(4, 4, krot=True, vrot=True)})
        for i in (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16)
    },
}  # fmt: skip


# -- fake quantization ---------------------------------------------------------------
def rot(x: mx.array) -> mx.array:
    return mx.hadamard_transform(x, scale=1.0 / math.sqrt(x.shape[-1]))


def nuq_levels(bits: int, eps: float) -> mx.array:
    """2**bits levels in [0, 1], the ends included, spaced as the quantiles of
    a normal distribution between eps and 1 - eps (denser in the middle)."""
    from statistics import NormalDist

    n = 2**bits
    z = [NormalDist().inv_cdf(eps + (1 - 2 * eps) * i / (n - 1)) for i in range(n)]
    return mx.array([0.5 + 0.5 * v / z[-1] for v in z])


def affine(x: mx.array, bits: int, g: int, nuq: float | None = None) -> mx.array:
    """Quantize-dequantize along the last axis in groups of `g`: `mx.quantize`
    with 16-bit scales and biases where it applies, the same affine rule
    (min/max per group) otherwise; with `nuq`, the levels between a group's
    min and max are `nuq_levels(bits, nuq)` instead of evenly spaced."""
    if nuq is None and g in (32, 64, 128) and x.shape[-1] % g == 0:
        w, s, b = mx.quantize(x, group_size=g, bits=bits)
        s = s.astype(mx.float16).astype(mx.float32)
        b = b.astype(mx.float16).astype(mx.float32)
        return mx.dequantize(w, s, b, group_size=g, bits=bits)
    shape = x.shape
    y = x.reshape(*shape[:-1], shape[-1] // g, g)
    lo, hi = y.min(-1, keepdims=True), y.max(-1, keepdims=True)
    if nuq is not None:
        lo = lo.astype(mx.float16).astype(mx.float32)
        span = mx.maximum(hi - lo, 1e-8).astype(mx.float16).astype(mx.float32)
        lv = nuq_levels(bits, nuq)
        u = (y - lo) / span
        i = mx.argmin(mx.abs(u[..., None] - lv), axis=-1)
        return (lv[i] * span + lo).reshape(shape)
    n = 2**bits - 1
    s = mx.maximum(hi - lo, 1e-8) / n
    return (mx.clip(mx.round((y - lo) / s), 0, n) * s + lo).reshape(shape)


def per_token(x: mx.array, bits: int | None, g: int, rotated: bool, nuq=None) -> mx.array:
    if bits is None:
        return x
    y = affine(rot(x) if rotated else x, bits, g, nuq)
    return rot(y) if rotated else y


def per_channel(x: mx.array, bits: int | None, g: int, rotated: bool, nuq=None) -> mx.array:
    """(B, H, N, D) quantized along the N tokens, `g` tokens per group."""
    if bits is None:
        return x
    y = affine((rot(x) if rotated else x).swapaxes(-1, -2), bits, g, nuq).swapaxes(-1, -2)
    return rot(y) if rotated else y


def with_outliers_exact(quant, x: mx.array, n: int) -> mx.array:
    """`quant(x)` with the `n` channels of largest magnitude (per batch row
    and head, over the tokens of `x`) kept exact."""
    top = mx.argsort(-mx.abs(x).max(axis=2), axis=-1)[..., :n]  # (B, H, n)
    keep = mx.zeros(x.shape[:2] + (x.shape[-1],), mx.bool_)
    keep = mx.put_along_axis(keep, top, mx.array(True), axis=-1)[:, :, None, :]
    return mx.where(keep, x, quant(mx.where(keep, mx.zeros_like(x), x)))


def fp8(x: mx.array, g: int = 64) -> mx.array:
    """Each element as fp8 (e4m3), groups of `g` channels scaled so their
    largest magnitude is 448 (the scale in 16 bits)."""
    y = x.reshape(*x.shape[:-1], -1, g)
    s = (mx.abs(y).max(-1, keepdims=True) / 448).astype(mx.float16).astype(mx.float32)
    s = mx.maximum(s, 1e-12)
    return (mx.from_fp8(mx.to_fp8(y / s), mx.float32) * s).reshape(x.shape)


def flip_pairs(x: mx.array, traditional: bool) -> mx.array:
    """Negate the second coordinate of every RoPE pair: with it, rope(-p) =
    flip(rope(p)(flip(x))), whatever the rope's frequencies and scaling."""
    d = x.shape[-1]
    if traditional:
        sign = mx.where(mx.arange(d) % 2 == 1, -1.0, 1.0)
    else:
        sign = mx.where(mx.arange(d) >= d // 2, -1.0, 1.0)
    return x * sign.astype(x.dtype)


class FakeQuantCache(mlx_cache.KVCache):
    """Keeps exact K/V; hands out the scheme's fake-quantized copy.

    Tokens move from an exact tail to the quantized part once more than `R`
    tokens follow them, in whole groups of `G` tokens for per-channel keys
    (one token at a time otherwise); the first `S` tokens never move."""

    def __init__(self, scheme: dict, attn=None):
        super().__init__()
        self.s = scheme
        self.attn = attn
        self.rope = getattr(attn, "rope", None)
        self.basis = None  # (shift, scale) per head and channel, fixed at the first keys
        self.qk = self.qv = self.rk = self.rv = None
        self.sink_k = self.sink_v = None
        self.moved = 0  # tokens before the tail (sinks and quantized)

    def _quant_keys(self, k: mx.array, first: int) -> mx.array:
        s = self.s
        channel = s.get("kmode") == "channel"
        quant = per_channel if channel else per_token

        def q(x):
            return quant(x, s["kb"], s["kg"], s.get("krot", False), s.get("nuq"))

        if s.get("kb") is None:
            return k
        if s.get("prerope") and self.rope is not None:
            trad = getattr(self.rope, "traditional", False)
            pre = flip_pairs(self.rope(flip_pairs(k, trad), offset=first), trad)
            return self.rope(q(pre), offset=first)
        if s.get("kout"):
            return with_outliers_exact(q, k, s["kout"])
        if s.get("kbasis"):
            shift, scale = self._basis(k)
            return q((k - shift) / scale) * scale + shift
        return q(k)

    def _basis(self, k: mx.array) -> tuple[mx.array, mx.array]:
        """A fixed per-channel shift and scale, from the first keys the layer
        sees (`mean`: less their mean, which moves every score of a query
        alike; `absmax`: over their largest magnitude, RoPE pairs alike) or
        from the weights (`knorm`: over Gemma's k_norm weight, 1 + w)."""
        if self.basis is None:
            how = self.s["kbasis"]
            shift, scale = mx.zeros((1, 1, 1, k.shape[-1])), mx.ones((1, 1, 1, k.shape[-1]))
            if how == "mean":
                shift = k.mean(axis=2, keepdims=True)
            else:
                w = (
                    mx.abs(1 + self.attn.k_norm.weight)
                    if how == "knorm"
                    else mx.abs(k).max(2, keepdims=True)
                )
                h = w.shape[-1] // 2  # non-traditional RoPE pairs i and i + d/2
                w = mx.concatenate([mx.maximum(w[..., :h], w[..., h:])] * 2, axis=-1)
                scale = mx.maximum(w, w.mean() / 8)
            self.basis = (shift, scale)
        return self.basis

    def update_and_fetch(self, keys, values):
        s = self.s
        keys, values = keys.astype(mx.float32), values.astype(mx.float32)
        cat = lambda a, b: b if a is None else mx.concatenate([a, b], axis=2)  # noqa: E731
        exact = (lambda a: a.astype(mx.float16).astype(mx.float32)) if s.get("x16") else None
        self.rk, self.rv = cat(self.rk, keys), cat(self.rv, values)
        self.offset += keys.shape[2]
        sinks = s.get("S", 0)
        if self.moved < sinks:
            n = min(sinks - self.moved, self.rk.shape[2])
            self.sink_k = cat(self.sink_k, self.rk[:, :, :n])
            self.sink_v = cat(self.sink_v, self.rv[:, :, :n])
            self.rk, self.rv = self.rk[:, :, n:], self.rv[:, :, n:]
            self.moved += n
        channel = s.get("kmode") == "channel"
        group = s["kg"] if channel else 1
        move = max(0, (self.rk.shape[2] - s.get("R", 0)) // group * group)
        if move:
            mk, mv = self.rk[:, :, :move], self.rv[:, :, :move]
            self.rk, self.rv = self.rk[:, :, move:], self.rv[:, :, move:]
            self.qk = cat(self.qk, self._quant_keys(mk, self.moved))
            self.qv = cat(
                self.qv, per_token(mv, s["vb"], s["vg"], s.get("vrot", False), s.get("nuq"))
            )
            self.moved += move
            mx.eval(self.qk, self.qv)
        rk, rv = self.rk, self.rv
        if s.get("partial") and rk.shape[2]:
            n = rk.shape[2]
            krot = s.get("krot", False)
            rk = per_channel(rk, s["kb"], n, krot) if n > 1 else per_token(rk, s["kb"], 64, krot)
            rv = per_token(rv, s["vb"], s["vg"], s.get("vrot", False))
        if s.get("tailfp8") and rk.shape[2]:
            rk, rv = fp8(rk), fp8(rv)
        if s.get("tail8") and rk.shape[2]:
            rk = per_token(rk, 8, 64, s.get("krot", False))
            rv = per_token(rv, 8, 64, s.get("vrot", False))
        sk, sv = self.sink_k, self.sink_v
        if exact is not None:
            rk, rv = exact(rk), exact(rv)
            sk, sv = (None, None) if sk is None else (exact(sk), exact(sv))
        ks = [a for a in (sk, self.qk, rk) if a is not None and a.shape[2]]
        vs = [a for a in (sv, self.qv, rv) if a is not None and a.shape[2]]
        self.keys = ks[0]
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        return k.astype(keys.dtype), v.astype(values.dtype)


def _attention_of(model, i: int):
    layers = getattr(getattr(model, "model", model), "layers", [])
    return getattr(layers[i], "self_attn", None) if i < len(layers) else None


def make_caches(model, scheme: dict) -> list:
    out = []
    exact = dict(FP, kg=64, vg=64)
    for i, c in enumerate(mlx_cache.make_prompt_cache(model)):
        kind = "sliding" if isinstance(c, mlx_cache.RotatingKVCache) else "full"
        if kind in scheme:
            s = {**exact, **scheme[kind]}
        elif "layers" in scheme:
            s = scheme if i in scheme["layers"] else exact
        else:
            s = scheme
        out.append(FakeQuantCache(s, _attention_of(model, i)))
    return out


def _layer_bits(s: dict, held: int) -> float:
    """Bits per element of one layer holding `held` tokens under scheme `s`,
    with the exact (full-precision) tail at its average length: `R` tokens,
    plus half a group for per-channel keys whose incomplete group stays exact."""

    def cost(bits, group):
        return 16.0 if bits is None else bits + 32 / group

    k, v = cost(s.get("kb"), s.get("kg", 64)), cost(s.get("vb"), s.get("vg", 64))
    if s.get("kb") is None and s.get("vb") is None:
        return 16.0
    if s.get("kout"):
        k = (k * (64 - s["kout"]) + 16.0 * s["kout"]) / 64  # head_dim 64
    tail = s.get("R", 0) + s.get("S", 0)
    if s.get("kmode") == "channel" and not s.get("partial"):
        tail += (s["kg"] - 1) / 2
    tail = min(tail, held)
    exact = 8.5 if s.get("tail8") else 8.25 if s.get("tailfp8") else 16.0
    return ((held - tail) * (k + v) / 2 + tail * exact) / held


def held_bits(model, scheme: dict, context: int = 2048) -> float:
    """Bits per element the scheme would hold at `context` tokens (sliding
    layers hold their window), as a real layout of it would."""
    total = slots = 0
    exact = dict(FP, kg=64, vg=64)
    for i, c in enumerate(mlx_cache.make_prompt_cache(model)):
        sliding = isinstance(c, mlx_cache.RotatingKVCache)
        held = min(context, c.max_size) if sliding else context
        kind = "sliding" if sliding else "full"
        if kind in scheme:
            s = {**exact, **scheme[kind]}
        elif "layers" in scheme:
            s = scheme if i in scheme["layers"] else exact
        else:
            s = scheme
        total += _layer_bits(s, held) * held
        slots += held
    return total / slots


# -- measurement --------------------------------------------------------------------
def log_probs(model, ids: mx.array, caches: list, chunk: int) -> mx.array:
    out = []
    for s in range(0, ids.size - 1, chunk):
        logits = model(ids[None, s : min(ids.size - 1, s + chunk)], cache=caches)[0]
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        out.append(lp)
    return mx.concatenate(out)


def measure(model, windows: list, base: list, scheme: dict, chunk: int) -> dict:
    kls, agree = [], []
    for w, lb in zip(windows, base, strict=True):
        lq = log_probs(model, mx.array(w), make_caches(model, scheme), chunk)
        kls.append(np.array((mx.exp(lb) * (lb - lq)).sum(-1)))
        agree.append(np.array(mx.argmax(lq, -1) == mx.argmax(lb, -1)).astype(float))
    se = lambda v: float(np.std(v, ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0  # noqa: E731
    return {
        "kl_mean": float(np.concatenate(kls).mean()),
        "kl_mean_se": se([k.mean() for k in kls]),
        "kl_p99": float(np.percentile(np.concatenate(kls), 99)),
        "top1": float(np.concatenate(agree).mean()),
        "top1_se": se([a.mean() for a in agree]),
    }


def run(args) -> dict:
    model, _, texts = load_eval_inputs(args.model, args.text)
    data = {}
    for name, (ids, bos) in texts.items():
        wins = cut_windows(ids, args.context, args.windows, bos)
        base = [
            log_probs(model, mx.array(w), mlx_cache.make_prompt_cache(model), args.chunk)
            for w in wins
        ]
        data[name] = (wins, base)
    cmd = (
        "python scripts/quality_explore.py "
        + (f"--model {args.model} " if args.model else "")
        + "".join(f"--text {t} " for t in args.text or ())
        + f"--context {args.context} --chunk {args.chunk} --windows {args.windows}"
    )
    raw_path = args.out or raw_file(args.model)
    old = json.loads(raw_path.read_text()) if raw_path.exists() else {}
    # --only updates a run with the same windows; other windows start afresh.
    results = old["results"] if old.get("command") == cmd else {}
    for label, (group, scheme) in {**SCHEMES, **REAL_SCHEMES}.items():
        if args.only and not {group, label} & set(args.only):
            continue
        t0 = time.perf_counter()
        res = {n: measure(model, w, b, scheme, args.chunk) for n, (w, b) in data.items()}
        bits = held_bits(model, scheme, args.held_context)
        results[label] = {"group": group, "scheme": scheme, "bits": bits,
                          "texts": res}  # fmt: skip
        line = " | ".join(
            f"{n}: KL {r['kl_mean']:.2e} top-1 {100 * r['top1']:.2f}%" for n, r in res.items()
        )
        print(f"{label}: {line} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    return {"command": cmd, "results": results}


def table(raw: dict) -> str:
    names = list(next(iter(raw["results"].values()))["texts"])
    lines = [
        "| scheme | bits/elem at 2,048 | "
        + " | ".join(f"mean KL, {n} | top-1, {n}" for n in names)
        + " |",
        "|---|---:|" + "---:|---:|" * len(names),
    ]
    known = {**SCHEMES, **REAL_SCHEMES}
    order = [k for k in known if k in raw["results"]]
    order += [k for k in raw["results"] if k not in known]
    for label in order:
        r = raw["results"][label]
        cells = []
        for n in names:
            t = r["texts"][n]
            cells += [
                f"{t['kl_mean']:.2e} ± {t['kl_mean_se']:.1e}",
                f"{100 * t['top1']:.2f}% ± {100 * t['top1_se']:.2f}",
            ]
        lines.append(f"| {label} | {r['bits']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def raw_file(model: str | None) -> Path:
    """docs/quality_explore.json for the gemma demo model,
    docs/quality_explore_<name>.json for another demo model."""
    from mlx_kvq.demo import demo_name

    name = demo_name(model) or Path(model).name
    return RAW if name == "gemma" else RAW.with_name(f"quality_explore_{name}.json")


def write_section(raw: dict, model: str | None = None) -> None:
    name = raw_file(model).stem.replace("quality_", "")
    text = DOC.read_text()
    body = f"Regenerate with `{raw['command']}`.\n\n{table(raw)}"
    block = f"<!-- BEGIN {name} -->\n{body}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {name} -->.*?<!-- END {name} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the gemma demo model (demo:gemma)")
    p.add_argument(
        "--text",
        type=Path,
        action="append",
        default=None,
        help="a text file (repeat; required with a model that is not a demo)",
    )
    p.add_argument("--context", type=int, default=512)
    p.add_argument(
        "--held-context",
        type=int,
        default=2048,
        help="the context bits per element are computed at",
    )
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument(
        "--only", action="append", default=None, help="a group or scheme label (repeat for more)"
    )
    p.add_argument("--render", action="store_true", help="rewrite the table from the JSON only")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON results file (default: docs/quality_explore[_NAME].json)",
    )
    args = p.parse_args(argv)
    use_fast_blas()  # as `mlx-kvq eval` measures (the recorded numbers were made so)
    path = args.out or raw_file(args.model)
    if args.render:
        raw = json.loads(path.read_text())
    else:
        raw = run(args)
        path.write_text(json.dumps(raw, indent=1) + "\n")
    if args.out is None:
        write_section(raw, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
