"""GGUF files in: block types repacked bit for bit, llama.cpp's conversions
undone, tokenizers rebuilt, unsupported files refused before any weight.

Tiny files are written here the way llama.cpp's converter writes them
(tests/kvq_testing/gguf_files.py); the real models are tested in
tests/test_real_models.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as reference_dequantize
from kvq_testing.gguf_files import reference_model, write_gguf
from kvq_testing.server import python_path

from mlx_kvq import from_gguf as gguf
from mlx_kvq.from_gguf.architectures import unpermute_rows
from mlx_kvq.from_gguf.tensors import _AFFINE, affine_values, decode_affine, pack_bits


@pytest.mark.parametrize("bits", [3, 4, 5, 6, 8])
def test_pack_bits_is_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 2**bits, size=(3, 128)).astype(np.uint8)
    got = mx.dequantize(
        mx.array(pack_bits(q, bits)), mx.ones((3, 4)), mx.zeros((3, 4)), group_size=32, bits=bits
    )
    assert np.array_equal(np.array(got), q.astype(np.float32))


def _random_blocks(name: str, rows: int, cols: int, rng) -> np.ndarray:
    _, per_block, block_bytes, _ = _AFFINE[name]
    blocks = rng.integers(0, 256, size=(rows, cols // per_block, block_bytes), dtype=np.uint8)
    halves = 2 if name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else 1  # d (and m / dmin)
    for k in range(halves):
        d = rng.uniform(-0.05, 0.05, size=(rows, cols // per_block)).astype(np.float16)
        blocks[..., 2 * k : 2 * k + 2] = d.view(np.uint8).reshape(rows, cols // per_block, 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", sorted(_AFFINE))
def test_block_types_repack_exactly(name):
    """Every mapped block type: MLX's dequantization of the repacked tensor
    equals gguf's reference dequantization of the block, value for value."""
    rng = np.random.default_rng(len(name))
    raw = _random_blocks(name, 5, 512, rng)
    want = reference_dequantize(raw, GGMLQuantizationType[name]).reshape(5, 512)
    packed = decode_affine(name, raw, (5, 512))
    assert np.array_equal(affine_values(packed), want)
    got = mx.dequantize(
        mx.array(packed.weight),
        mx.array(packed.scales.astype(np.float32)),
        mx.array(packed.biases.astype(np.float32)),
        group_size=32,
        bits=packed.bits,
    )
    assert np.array_equal(np.array(got), want)


def test_scales_stay_float16_only_where_exact():
    rng = np.random.default_rng(0)
    q4_0 = decode_affine("Q4_0", _random_blocks("Q4_0", 2, 64, rng), (2, 64))
    q4_k = decode_affine("Q4_K", _random_blocks("Q4_K", 2, 256, rng), (2, 256))
    assert q4_0.scales.dtype == np.float16 and q4_0.biases.dtype == np.float16
    assert q4_k.scales.dtype == np.float32  # d * sc needs more than float16's mantissa


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8 * 3, 4)
    heads = 3
    permuted = w.reshape(heads, 2, 4, 4).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_rows(permuted, heads), w)


@pytest.mark.parametrize(
    "arch,weight_type",
    [
        ("llama", "Q8_0"),
        ("llama", "Q4_0"),
        ("qwen2", "Q5_0"),
        ("qwen3", "Q4_1"),
        ("gemma3", "Q8_0"),
    ],
)
def test_converted_model_computes_what_the_file_holds(tmp_path, arch, weight_type):
    """The converted model's logits equal those of the same mlx-lm model given
    the weights the file holds (permutes and norm offsets undone)."""
    path, held, config = write_gguf(tmp_path / f"{arch}.gguf", arch, weight_type)
    conversion = gguf.convert(path, tmp_path / "out", dtype="float32")
    matrices = sum(1 for v in held.values() if v.ndim == 2)  # projections, embedding, head
    assert conversion.treatments[weight_type] == {"packed": matrices}
    from mlx_lm import load

    model, tokenizer = load(str(tmp_path / "out"))
    want = reference_model(config, held)
    x = mx.array([[5, 9, 17, 30, 4, 11, 2, 8, 40, 33, 7, 12]])
    got, ref = model(x), want(x)
    assert got.dtype == mx.float32
    assert mx.abs(got - ref).max().item() < 1e-4 * max(1.0, mx.abs(ref).max().item())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == config["model_type"]
    assert written["quantization"]["group_size"] == 32


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_tokenizer_round_trips(tmp_path, arch):
    path, _, _ = write_gguf(tmp_path / "t.gguf", arch)
    gguf.convert(path, tmp_path / "out", dtype="float32")
    from mlx_lm import load

    _, tok = load(str(tmp_path / "out"))
    text = "the then in an a théâtre 🙂\n\n  x\t"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    if arch == "gemma3":
        assert tok.encode("the")[0] == 2  # the file says add BOS
        pieces = tok.convert_ids_to_tokens(tok.encode(" the then", add_special_tokens=False))
        assert pieces == ["▁the", "▁the", "n"]  # the highest-scoring merges first
        assert 6 in tok.encode("a\n\nb")  # user-defined "\n\n" matched whole
        assert 5 in tok.eos_token_ids  # <end_of_turn> ends a turn
    else:
        assert tok.convert_ids_to_tokens(tok.encode(" the", add_special_tokens=False)) == ["Ġthe"]
        chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        assert chat.startswith("<|im_start|>user\nhi<|im_end|>")
        assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
        assert set(tok.eos_token_ids) == {0, 2}


def test_converted_cache_is_reused_and_keyed_by_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_KVQ_CACHE", str(tmp_path / "cache"))
    path, _, _ = write_gguf(tmp_path / "m.gguf", "qwen3")
    first, conversion, fresh = gguf.converted(path, "float32")
    again, _, fresh_again = gguf.converted(path, "float32")
    assert fresh and not fresh_again and first == again
    assert conversion.source_bytes == path.stat().st_size
    other, _, _ = gguf.converted(path, "float16")
    assert other != first  # another dtype is another conversion


def _unsupported_file(path, arch="mamba"):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_exits_2_naming_it(tmp_path):
    path = _unsupported_file(tmp_path / "m.gguf")
    env = {"PYTHONPATH": python_path({}), "MLX_KVQ_CACHE": str(tmp_path / "cache"), "PATH": ""}
    for argv in (["serve", "--model", str(path)], ["convert", str(path), str(tmp_path / "o")]):
        out = subprocess.run(
            [sys.executable, "-m", "mlx_kvq", *argv], capture_output=True, text=True, env=env
        )
        assert out.returncode == 2, out.stderr
        assert "'mamba' is not supported" in out.stderr
    assert not (tmp_path / "cache" / "gguf").exists() or not any(
        (tmp_path / "cache" / "gguf").iterdir()
    )


def test_truncated_file_is_refused(tmp_path):
    path, _, _ = write_gguf(tmp_path / "m.gguf", "qwen3")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(gguf.UnsupportedModel, match="cut short|ends inside"):
        gguf.convert(cut, tmp_path / "out")
