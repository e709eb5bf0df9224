"""Prompt-cache files holding quantized caches.

mlx-lm's own save_prompt_cache/load_prompt_cache (and our wrappers) must
round-trip every cache exactly (ring index, sink tokens, raw-until-start
stores included); generation continued from a loaded cache gives the same
tokens as from the cache that was never saved; unknown classes and
mismatched settings are refused clearly.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.helpers import prompt_tokens, tiny_model
from mlx.utils import tree_flatten
from mlx_lm.models import cache as mlx_cache

import mlx_kvq
from mlx_kvq import KVConfig, UnsupportedKVConfig
from mlx_kvq.caches import (
    KVQBatchFullCache,
    KVQBatchWindowCache,
    KVQChunkedCache,
    KVQFullCache,
    KVQWindowCache,
)
from mlx_kvq.config import QuantSpec
from mlx_kvq.generate import load_prompt_cache, save_prompt_cache

H, D = 2, 64
Q4, Q8 = QuantSpec(4), QuantSpec(8)


def _kv(rng, b, n):
    x = mx.array(rng.standard_normal((b, H, n, D)).astype(np.float32))
    return x, -x


def _fill(cache, rng, chunks, b=1):
    for n in chunks:
        if hasattr(cache, "maybe_trim_front"):
            cache.maybe_trim_front()
        cache.update_and_fetch(*_kv(rng, b, n))
    mx.eval(cache.state)
    return cache


def _flat(cache):
    return tree_flatten(cache.state)


def assert_same_cache(a, b):
    assert type(a) is type(b)
    fa, fb = _flat(a), _flat(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    for (k, x), (_, y) in zip(fa, fb, strict=True):
        if isinstance(x, mx.array):
            assert x.dtype == y.dtype and mx.array_equal(x, y).item(), k
        else:
            assert x == y, k
    assert (a.key_spec, a.value_spec, a.start, a.hand_out, a.dtype) == (
        b.key_spec, b.value_spec, b.start, b.hand_out, b.dtype,
    )  # fmt: skip


def _caches(rng):
    """One of each kind, mid-ring windows included."""
    full = _fill(KVQFullCache(Q4, Q8), rng, [9, 1, 1])
    raw = _fill(KVQFullCache(Q4, Q4, start=100), rng, [5, 1])  # not yet converted
    ring = _fill(KVQWindowCache(8, Q4, Q4), rng, [13, 1, 1, 1])  # wrapped, _idx mid-ring
    sinks = _fill(KVQWindowCache(10, Q8, Q4, keep=3), rng, [12, 1, 1, 1, 1, 1])
    rot = _fill(KVQWindowCache(8, QuantSpec(4, 64, "hadamard"), Q4), rng, [3, 1])
    chunked = _fill(KVQChunkedCache(8, Q4, Q4), rng, [6, 5, 1, 1])
    empty = KVQFullCache(Q4, Q4)
    return [full, raw, ring, sinks, rot, chunked, empty]


def test_mlx_lm_files_round_trip_every_cache(tmp_path):
    rng = np.random.default_rng(0)
    caches = _caches(rng)
    ring, sinks = caches[2], caches[3]
    assert ring.offset > ring.max_size and 0 < ring._idx < ring.max_size
    assert sinks.keep == 3 and sinks.keep < sinks._idx < sinks.max_size
    assert not caches[1].quantized and caches[0].quantized
    path = str(tmp_path / "p.safetensors")
    mlx_cache.save_prompt_cache(path, caches, {"note": "x"})
    loaded, meta = mlx_cache.load_prompt_cache(path, return_metadata=True)
    assert meta["note"] == "x"
    for a, b in zip(caches, loaded, strict=True):
        assert_same_cache(a, b)
    # The loaded caches keep working like the originals.
    for a, b in zip(caches, loaded, strict=True):
        for n in (1, 3, 1):
            k, v = _kv(rng, 1, n)
            if isinstance(a, KVQChunkedCache):
                a.maybe_trim_front()
                b.maybe_trim_front()
            if isinstance(a, KVQWindowCache):
                assert _mask_eq(a.make_mask(n, window_size=5), b.make_mask(n, window_size=5))
            ga, gb = a.update_and_fetch(k, v), b.update_and_fetch(k, v)
            for x, y in zip(ga, gb, strict=True):
                for p, q in zip(_parts(x), _parts(y), strict=True):
                    assert mx.array_equal(p, q).item()
        assert_same_cache(a, b)


def _parts(x):
    return (x.data, x.scales, x.biases) if hasattr(x, "data") else (x,)


def _mask_eq(a, b):
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return mx.array_equal(a, b).item()
    return a == b


def test_batch_caches_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    full = KVQFullCache.merge([_fill(KVQFullCache(Q4, Q4), rng, [n]) for n in (3, 9)])
    win = KVQWindowCache.merge([_fill(KVQWindowCache(8, Q4, Q4), rng, [n]) for n in (4, 12)])
    for _ in range(11):  # rotate the batch ring
        full.update_and_fetch(*_kv(rng, 2, 1))
        win.update_and_fetch(*_kv(rng, 2, 1))
    assert win.rotated
    path = str(tmp_path / "b.safetensors")
    mlx_cache.save_prompt_cache(path, [full, win])
    loaded = mlx_cache.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [KVQBatchFullCache, KVQBatchWindowCache]
    for a, b in zip([full, win], loaded, strict=True):
        assert_same_cache(a, b)
        k, v = _kv(rng, 2, 1)
        assert mx.array_equal(a.make_mask(1), b.make_mask(1)).item()
        ka, kb = a.update_and_fetch(k, v)[0], b.update_and_fetch(k, v)[0]
        assert mx.array_equal(ka.data, kb.data).item()


# -- continuing generation -------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma():
    return tiny_model("gemma3_text")


def _prefill(model, tokens, bits, step=None):
    cache = mlx_kvq.make_prompt_cache(model, kv_bits=bits, quantized_kv_start=step or 0)
    for i in range(0, tokens.size - 3, 10):  # chunks, then 3 single tokens: mid-ring
        model(tokens[None, i : min(i + 10, tokens.size - 3)], cache=cache)
    for i in range(tokens.size - 3, tokens.size):
        model(tokens[None, i : i + 1], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _continue(model, cache, bits):
    last = mx.array([7])
    gen = mlx_kvq.generate_step(last, model, prompt_cache=cache, kv_bits=bits, max_tokens=12)
    return [int(t) for t, _ in gen]


@pytest.mark.parametrize("via", ["mlx_lm", "mlx_kvq"])
@pytest.mark.parametrize("bits", [4, 8])
def test_generation_continues_identically_after_load(gemma, tmp_path, via, bits):
    tokens = prompt_tokens(33)
    path = str(tmp_path / "g.safetensors")
    saved = _prefill(gemma, tokens, bits)
    windows = [c for c in saved if isinstance(c, KVQWindowCache)]
    assert windows and all(0 < c._idx < c.max_size < c.offset for c in windows)
    if via == "mlx_lm":
        mlx_cache.save_prompt_cache(path, saved)
        loaded = mlx_cache.load_prompt_cache(path)
    else:
        save_prompt_cache(path, saved, {"model": "tiny"})
        loaded, meta = load_prompt_cache(path, return_metadata=True, expect=KVConfig(bits=bits))
        assert meta["model"] == "tiny" and "mlx_kvq" in meta
    for a, b in zip(saved, loaded, strict=True):
        assert_same_cache(a, b)
    want = _continue(gemma, _prefill(gemma, tokens, bits), bits)  # never saved
    assert _continue(gemma, loaded, bits) == want


# -- refusals ------------------------------------------------------------------------
class ForeignCache(mlx_cache._BaseCache):
    """A cache class nobody registered (another library or version)."""

    def __init__(self):
        self.x = mx.zeros((2,))

    @property
    def state(self):
        return [self.x]


def test_unknown_class_is_a_clear_value_error(tmp_path):
    path = str(tmp_path / "u.safetensors")
    mlx_cache.save_prompt_cache(path, [KVQFullCache(Q4, Q4), ForeignCache()])
    with pytest.raises(KeyError):  # what mlx-lm alone does
        mlx_cache.load_prompt_cache(path)
    with pytest.raises(ValueError, match="ForeignCache") as info:
        load_prompt_cache(path)
    assert not isinstance(info.value, KeyError)
    with pytest.raises(FileNotFoundError):
        load_prompt_cache(str(tmp_path / "missing.safetensors"))


def test_expect_refuses_mismatched_settings_on_any_layer(tmp_path):
    rng = np.random.default_rng(2)
    layers = [_fill(KVQWindowCache(8, Q4, Q4), rng, [9]), _fill(KVQFullCache(Q4, Q4), rng, [9])]
    layers += [_fill(KVQWindowCache(8, Q4, Q4), rng, [9]), _fill(KVQFullCache(Q8, Q4), rng, [9])]
    path = str(tmp_path / "m.safetensors")
    save_prompt_cache(path, layers)
    with pytest.raises(UnsupportedKVConfig, match="layer 3"):  # not only layer 0
        load_prompt_cache(path, expect=KVConfig(bits=4))
    with pytest.raises(UnsupportedKVConfig, match="layer 0"):  # layer 3's settings
        load_prompt_cache(path, expect=KVConfig(bits=4, key_bits=8))
    assert len(load_prompt_cache(path)) == 4  # no expectation: loads

    same = [_fill(KVQFullCache(Q4, Q4), rng, [9]) for _ in range(3)]
    save_prompt_cache(path, same)
    assert len(load_prompt_cache(path, expect=KVConfig(bits=4))) == 3
    for bad in (KVConfig(bits=8), KVConfig(bits=4, group_size=32), KVConfig(bits=4, rotation="hadamard"),
                KVConfig(bits=4, value_bits=8)):  # fmt: skip
        with pytest.raises(UnsupportedKVConfig, match="layer 0"):
            load_prompt_cache(path, expect=bad)
    # An unquantized file when quantized settings are expected.
    plain = [mlx_cache.KVCache()]
    plain[0].update_and_fetch(*_kv(rng, 1, 3))
    mlx_cache.save_prompt_cache(path, plain)
    with pytest.raises(UnsupportedKVConfig, match="unquantized"):
        load_prompt_cache(path, expect=KVConfig(bits=4))
    assert len(load_prompt_cache(path, expect=KVConfig())) == 1


def _rewritten(src: str, dst: str, arrays: dict | None = None, meta: dict | None = None) -> str:
    """A copy of the prompt file `src` with some arrays or metadata entries replaced."""
    a, m = mx.load(src, return_metadata=True)
    mx.save_safetensors(dst, {**a, **(arrays or {})}, {**m, **(meta or {})})
    return dst


def _text(s: str) -> mx.array:
    return mx.array([ord(c) for c in s], dtype=mx.int32)


def test_bad_prompt_cache_files_exit_2_with_the_reason(tmp_path, capsys):
    from mlx_kvq.commands import main

    rng = np.random.default_rng(3)
    good = str(tmp_path / "good.safetensors")
    save_prompt_cache(good, [_fill(KVQFullCache(Q4, Q4), rng, [9])])
    raw = open(good, "rb").read()
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) // 2])
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\xff" * 64)
    # Scalars are stored as arrays: "0.1" is layer 0's offset, "0.2.8" its dtype name.
    cases = {
        str(truncated): "cannot be read",
        str(garbage): "cannot be read",
        _rewritten(good, str(tmp_path / "neg.safetensors"), {"0.1": mx.array(-5)}): "offset -5",
        _rewritten(good, str(tmp_path / "eval.safetensors"), {"0.2.8": _text("eval")}):
            "unknown dtype 'eval'",
        _rewritten(good, str(tmp_path / "mx.safetensors"), meta={"1.0": "mx"}): "['mx']",
        _rewritten(good, str(tmp_path / "builtins.safetensors"), meta={"1.0": "__builtins__"}):
            "['__builtins__']",
    }  # fmt: skip
    for path, reason in cases.items():
        code = main(["generate", "--prompt", "Hi", "--max-tokens", "2",
                     "--prompt-cache-file", path, "--kv-bits", "4"])  # fmt: skip
        err = capsys.readouterr().err
        assert code == 2, (path, err)
        assert path in err and reason in err, (path, err)
    assert len(load_prompt_cache(good, expect=KVConfig(bits=4))) == 1
