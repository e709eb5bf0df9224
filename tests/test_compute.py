"""The CPU backend's choices at load (`mlx_kvq.compute.prepare`): half-precision
weights compute in float32 unless `--dtype` says otherwise, and quantized
layers multiply batches by their dequantized weights, with the same result."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from kvq_testing.archs import build_model as tiny_model

from mlx_kvq.compute import (
    DENSE_ROWS,
    MIN_BLAS_ROWS,
    BatchDenseQuantizedEmbedding,
    BatchDenseQuantizedLinear,
    prepare,
)


def _dtypes(model) -> set:
    return {p.dtype for _, p in nn.utils.tree_flatten(model.parameters())}


def test_half_precision_computes_in_float32_and_says_so():
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    x = mx.array([[1, 2, 3, 4]])
    want = model(x).astype(mx.float32)
    done = prepare(model)
    assert done.cast_from == "bfloat16" and "--dtype bfloat16" in done.line()
    assert _dtypes(model) == {mx.float32}
    got = model(x)
    assert got.dtype == mx.float32
    assert mx.abs(got - want).max().item() < 0.1 * mx.abs(want).max().item()


def test_an_explicit_dtype_is_kept():
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    done = prepare(model, "bfloat16")
    assert done.cast_from is None and "float32" not in done.line()
    assert _dtypes(model) == {mx.bfloat16}
    with pytest.raises(ValueError, match="--dtype"):
        prepare(model, "int8")


def test_float32_model_is_left_alone():
    model = tiny_model("llama")
    before = {k: v for k, v in nn.utils.tree_flatten(model.parameters())}
    done = prepare(model)
    assert done.cast_from is None and done.dense_batch_layers == 0
    assert "float32" not in done.line()
    after = dict(nn.utils.tree_flatten(model.parameters()))
    assert all(after[k] is v for k, v in before.items())


def test_quantized_layers_take_batches_through_the_dense_product():
    model = tiny_model("llama")
    nn.quantize(model, group_size=32, bits=4)
    reference = tiny_model("llama")
    nn.quantize(reference, group_size=32, bits=4)
    reference.update(model.parameters())
    done = prepare(model)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    embeddings = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert done.dense_batch_layers == len(linears) + len(embeddings) > 1
    assert all(type(m) is BatchDenseQuantizedLinear for m in linears)
    assert all(type(m) is BatchDenseQuantizedEmbedding for m in embeddings)
    assert "weights stay packed" in done.line()
    # a decode step (one position a sequence): the packed product, whatever the batch
    step = mx.array([[3]] * (DENSE_ROWS + 1))
    assert mx.array_equal(model(step), reference(step))
    # a prompt chunk (two positions or more): the dequantized weights on the BLAS
    for chunk in (mx.array([[1, 2]]), mx.array([list(range(1, DENSE_ROWS + 9))])):
        got, want = model(chunk), reference(chunk)
        assert not mx.array_equal(got, want)
        assert mx.abs(got - want).max().item() < 1e-3 * mx.abs(want).max().item()


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """OpenBLAS's small-matrix kernels round otherwise than its large ones:
    every product through the BLAS has at least MIN_BLAS_ROWS rows, so the
    last rows of a chunk equal the same rows of a longer one, bit for bit."""
    dense = tiny_model("llama")
    quantized = tiny_model("llama")
    nn.quantize(quantized, group_size=32, bits=4)
    x = mx.random.normal((1, 300, 128), key=mx.random.key(2))
    for model in (dense, quantized):
        prepare(model)
        layer = model.layers[0].mlp
        whole = layer(x)
        for n in (2, 3, 5, 9, MIN_BLAS_ROWS + 1):
            assert mx.array_equal(layer(x[:, -n:]), whole[:, -n:]).item(), n


def test_tied_output_layer_takes_batches_in_vocabulary_chunks(monkeypatch):
    import mlx_kvq.compute as compute

    monkeypatch.setattr(compute, "VOCAB_CHUNK", 48)  # several chunks on a tiny vocabulary
    emb = nn.Embedding(200, 64)
    q = nn.QuantizedEmbedding.from_embedding(emb, group_size=32, bits=4)
    want = q.as_linear(mx.ones((1, DENSE_ROWS, 64)))
    q.__class__ = BatchDenseQuantizedEmbedding
    got = q.as_linear(mx.ones((1, DENSE_ROWS, 64)))
    assert got.shape == want.shape == (1, DENSE_ROWS, 200)
    assert mx.abs(got - want).max().item() < 1e-4 * mx.abs(want).max().item()
