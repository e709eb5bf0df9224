"""MLX's float products run on OpenBLAS after a plain install on Linux, once
the program asks (`mlx_kvq.use_fast_blas()`, which every `mlx-kvq` command
calls; tests/conftest.py does it for the suite).

What is checked is the library the loader maps libmlx's `cblas_sgemm`
slot to (`blas_info`), never a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_kvq
from mlx_kvq import blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheels only")

REPORT = "import json; print(json.dumps(mlx_kvq.blas_info().to_dict()))"


def _info_in_subprocess(first: str, env: dict[str, str] | None = None) -> dict:
    code = f"{first}\n{REPORT}"
    environ = {k: v for k, v in os.environ.items() if k != blas.ENV}
    environ.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=environ
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@linux
@pytest.mark.parametrize(
    "first",
    [
        "import mlx_kvq; mlx_kvq.use_fast_blas()",
        "import mlx.core as mx; mx.eval(mx.ones((4, 4)) @ mx.ones((4, 4)));"
        " import mlx_kvq; mlx_kvq.use_fast_blas()",
    ],
    ids=["mlx_kvq-first", "mlx-first-and-used"],
)
def test_openblas_after_use_fast_blas(first):
    """Either import order, then `use_fast_blas()`, ends with libmlx's `cblas_sgemm` resolving into
    the scipy-openblas32 package's library."""
    info = _info_in_subprocess(first)
    assert info["kind"] == "OpenBLAS", info
    assert info["binding"] == "rebound by mlx-kvq"
    assert "scipy_openblas32" in info["library"]
    assert info["symbol"] == "scipy_cblas_sgemm"
    assert info["fast"] is True


@linux
@pytest.mark.parametrize("value", ["reference", "0"])
def test_opt_out_keeps_the_linked_reference_blas(value):
    info = _info_in_subprocess("import mlx_kvq; mlx_kvq.use_fast_blas()", {blas.ENV: value})
    assert info["kind"] == "reference BLAS", info
    assert info["binding"] == "as linked"
    assert "mlx_cpu.libs" in info["library"] and "libblas" in info["library"]
    assert blas.ENV in info["reason"]


@linux
def test_explicit_library_and_a_bad_value():
    bundled = blas.blas_info().library
    info = _info_in_subprocess("import mlx_kvq; mlx_kvq.use_fast_blas()", {blas.ENV: bundled})
    assert info["kind"] == "OpenBLAS" and info["reason"] == f"{blas.ENV}={bundled}"
    environ = {**os.environ, blas.ENV: "/no/such/libblas.so"}
    code = "import mlx_kvq; mlx_kvq.use_fast_blas()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert out.returncode != 0
    assert f"{blas.ENV}='/no/such/libblas.so': no such file" in out.stderr
    # a command refuses it as a bad setting (status 2), naming the variable
    cmd = [sys.executable, "-m", "mlx_kvq", "plan", "--context", "64"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=environ)
    assert out.returncode == 2, out.stderr
    assert f"{blas.ENV}='/no/such/libblas.so': no such file" in out.stderr


@linux
def test_linked_blas_for_a_block_and_results_agree():
    """`use_linked_blas` swaps the reference BLAS in for the block and back;
    both give the same products within float32 rounding."""
    assert mlx_kvq.blas_info().kind is blas.BlasKind.OPENBLAS
    mx.random.seed(0)
    a = mx.random.normal((96, 300))
    b = mx.random.normal((300, 70))
    c = mx.random.normal((2, 5, 300)) + 1j * mx.random.normal((2, 5, 300))
    d = mx.random.normal((300, 3)).astype(mx.complex64)
    a64, b64 = a.astype(mx.float64), b.astype(mx.float64)

    def products():
        out = (a @ b, mx.addmm(b[:70, :], a[:70, :], b), c @ d, a64 @ b64)
        mx.eval(out)
        return out

    fast = products()
    with blas.use_linked_blas() as info:
        assert info.kind is blas.BlasKind.REFERENCE and info.binding is blas.BlasBinding.LINKED
        assert mlx_kvq.blas_info().kind is blas.BlasKind.REFERENCE
        ref = products()
    assert mlx_kvq.blas_info().kind is blas.BlasKind.OPENBLAS
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    for f, r in zip(fast, ref, strict=True):
        assert f.shape == r.shape and f.dtype == r.dtype
        tol = (1e-12 if f.dtype == mx.float64 else 1e-5) * np.abs(np.asarray(r)).max() * 20
        assert np.abs(np.asarray(f) - np.asarray(r)).max() <= tol
    assert np.abs(np.asarray(fast[0]) - exact).max() <= 1e-5 * np.abs(exact).max()
    assert np.abs(np.asarray(fast[3]) - exact).max() <= 1e-12 * np.abs(exact).max()


def test_summary_names_the_library():
    info = mlx_kvq.blas_info()
    text = info.summary()
    assert info.binding.value in text and info.reason in text
    assert set(info.to_dict()) >= {"kind", "library", "symbol", "binding", "reason", "fast"}
