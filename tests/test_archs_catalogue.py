"""The tiny architecture catalogue (kvq_testing.archs) against the installed mlx-lm.

(a) every module file of mlx_lm/models is either configured or skipped with a reason;
(b) every configured tiny model builds and runs a chunked prefill + decode with mlx-lm's
    own (unquantized) caches, with finite logits and the recorded cache layout.
"""

from __future__ import annotations

import pathlib

import mlx.core as mx
import mlx_lm.models
import pytest
from kvq_testing import archs

MODELS_DIR = pathlib.Path(mlx_lm.models.__file__).parent
MODULE_FILES = sorted(p.stem for p in MODELS_DIR.glob("*.py") if p.stem != "__init__")


def test_every_module_is_configured_or_skipped():
    configured = {archs.module_name(k) for k in archs.TINY_CONFIGS}
    skipped = set(archs.SKIPPED)
    files = set(MODULE_FILES)
    assert not configured & skipped, f"both configured and skipped: {configured & skipped}"
    missing = files - configured - skipped
    assert not missing, f"mlx_lm.models modules neither configured nor skipped: {sorted(missing)}"
    stale = (configured | skipped) - files
    assert not stale, f"entries for modules that mlx_lm no longer has: {sorted(stale)}"


def test_skip_reasons_and_metadata():
    for name, reason in archs.SKIPPED.items():
        assert isinstance(reason, str) and len(reason) > 10, name
    assert set(archs.FEATURES) <= set(archs.TINY_CONFIGS)
    assert set(archs.CACHE_LAYOUT) == set(archs.TINY_CONFIGS), (
        "CACHE_LAYOUT is stale: run python scripts/survey_archs.py --write"
    )
    for name, cfg in archs.TINY_CONFIGS.items():
        assert "model_type" in cfg, name
        module = archs.module_name(name)
        assert name == module or name.startswith(module + ":"), name


@pytest.mark.parametrize("name", list(archs.TINY_CONFIGS))
def test_tiny_model_runs_with_mlx_lm_caches(name):
    model = archs.build_model(name)
    tokens = archs.prompt_tokens()
    cache, logits = archs.run_forward(model, tokens, return_logits=True)
    assert len(logits) == len(archs.PREFILL_CHUNKS) + archs.DECODE_STEPS
    assert all(lg.shape[-1] == logits[0].shape[-1] for lg in logits)
    assert archs.logits_finite(model, logits), f"{name}: non-finite logits"
    assert archs.describe_cache(cache) == archs.CACHE_LAYOUT[name]
    # the prompt's 40 tokens + 5 decoded ones went through every KV-style cache
    for c in archs._flat_caches(cache):
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and offset:
            assert offset == archs.PROMPT_LEN + archs.DECODE_STEPS, (name, type(c).__name__)


def test_sliding_windows_wrap_inside_the_prompt():
    """Sliding-window configs use windows that wrap inside the 40-token prompt, next to
    full-attention (or recurrent) layers."""
    for name, feats in archs.FEATURES.items():
        if "sliding" not in feats or name == "deepseek_v41":  # custom LayerCache window
            continue
        layout = archs.CACHE_LAYOUT[name]
        assert "RotatingKVCache(" in layout, name
        windows = {int(w) for w in _between(layout, "RotatingKVCache(", ")")}
        assert all(w < archs.PROMPT_LEN for w in windows), (name, windows)
        assert "KVCache[" in layout.replace("RotatingKVCache", "") or "ArraysCache" in layout, name


def test_cached_head_dims_are_multiples_of_64():
    """KV quantization with group size 64 must divide every cached key / value dim
    (zero-width values: minimax_m3_vl's indexer cache stores keys only)."""
    for name, layout in archs.CACHE_LAYOUT.items():
        for dims in _between(layout, "[", "]"):
            heads, kv = dims.split("x")
            k, v = (int(d) for d in kv.split("/"))
            assert int(heads) >= 1 and k % 64 == 0 and v % 64 == 0, (name, dims)


def test_build_model_casts_dtype():
    model = archs.build_model("llama", dtype=mx.bfloat16)
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    cache, logits = archs.run_forward(model, return_logits=True)
    assert archs.logits_finite(model, logits)


def _between(s: str, start: str, end: str) -> list[str]:
    out, i = [], s.find(start)
    while i >= 0:
        j = s.index(end, i + len(start))
        out.append(s[i + len(start) : j])
        i = s.find(start, j)
    return out
