"""mlx-kvq: quantized KV caches for every attention layout in mlx-lm models.

`import mlx_kvq` stays light: it loads only the settings (`KVConfig`,
`QuantSpec`, `UnsupportedKVConfig`) and MLX's core, and changes nothing it
does not own: MLX's float products keep the BLAS they were linked with until
the program calls `use_fast_blas()` (OpenBLAS on Linux, `mlx_kvq.blas`; every
`mlx-kvq` command does; `blas_info()` says which library is in use).
Importing anything from mlx-lm loads its
package `__init__` (transformers, seconds of start-up), so the generation
entry points and the planner are resolved on first use. No module of the
package changes mlx-lm when imported: planning (`plan_kv`, which every entry
point does) redirects mlx-lm's attention to ours, and making the first cache
(or loading a prompt file) makes our cache classes loadable from mlx-lm
prompt-cache files.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .blas import blas_info, use_fast_blas
from .config import KVConfig, QuantSpec, UnsupportedKVConfig

if TYPE_CHECKING:  # pragma: no cover
    from .generate import (
        generate,
        generate_step,
        load_prompt_cache,
        make_prompt_cache,
        save_prompt_cache,
        stream_generate,
    )
    from .kernels import native_status
    from .plan import KVPlan, plan_kv

# Public name -> submodule defining it, imported on first access.
_LAZY = {
    "make_prompt_cache": "generate",
    "generate_step": "generate",
    "stream_generate": "generate",
    # `mlx_kvq.generate` is the `mlx_kvq.generate` module, which is callable as
    # the `generate` function (see the end of generate.py).
    "generate": "generate",
    "save_prompt_cache": "generate",
    "load_prompt_cache": "generate",
    "plan_kv": "plan",
    "KVPlan": "plan",
    "native_status": "kernels",
}

__all__ = [
    "KVConfig",
    "KVPlan",
    "QuantSpec",
    "UnsupportedKVConfig",
    "blas_info",
    "native_status",
    "generate",
    "generate_step",
    "load_prompt_cache",
    "make_prompt_cache",
    "plan_kv",
    "save_prompt_cache",
    "stream_generate",
    "use_fast_blas",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name]}", __name__)
    value = module if name == "generate" else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
