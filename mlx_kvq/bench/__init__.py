"""Speed and memory benchmark: `python -m mlx_kvq.bench` / `mlx-kvq bench`.

Sections (each measured side by side in one process, on one backend):

- ``attention``: our quantized attention, mlx-lm's quantized attention and
  unquantized ``mx.fast.scaled_dot_product_attention``, decode and prefill
  queries, several cached lengths and dtypes, with output errors;
- ``model``: prefill and decode tokens/s of a random-weight Gemma-like
  hybrid model with unquantized, 8-bit and 4-bit caches;
- ``memory``: KV bytes held per layer kind against theory, and peak memory
  during a long decode;
- ``serving``: aggregate generation tokens/s of the serving engine at
  several concurrent streams.

Results go to JSON, a markdown summary and (with matplotlib) PNG plots.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .cli import main as _main

    return _main(argv)
