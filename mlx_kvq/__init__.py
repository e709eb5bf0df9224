"""mlx-kvq: quantized KV caches for every attention layout in mlx-lm models."""

from . import attention as _attention
from .caches import register_for_prompt_files as _register
from .config import KVConfig, QuantSpec, UnsupportedKVConfig

_attention.install()
_register()

__all__ = ["KVConfig", "QuantSpec", "UnsupportedKVConfig"]
__version__ = "0.1.0"
