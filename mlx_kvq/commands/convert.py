"""`mlx-kvq convert FILE.gguf OUT_DIR`: a GGUF file as an mlx-lm directory to keep."""

from __future__ import annotations

import argparse
from pathlib import Path

DTYPE_CHOICES = ("float32", "float16", "bfloat16")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="write an mlx-lm directory (config, weights, tokenizer) from a GGUF file",
    )
    p.add_argument("gguf", help="the GGUF file (llama, qwen2, qwen3 or gemma3)")
    p.add_argument("out_dir", help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,
        help="dtype of the dense tensors (default: float32 on MLX's CPU backend, whose "
        "half-precision products do not use the BLAS; float16 elsewhere)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="make every weight dense, also the block types MLX's quantization holds "
        "exactly (kept packed by default): on the CPU backend the fastest form, at "
        "4-8x the bytes",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..from_gguf import check, convert, is_gguf

    if not is_gguf(args.gguf):
        raise FileNotFoundError(f"{args.gguf} is not a GGUF file")
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    check(args.gguf)
    conversion = convert(args.gguf, out, args.dtype, dequantize_all=args.dequantize)
    print(conversion.summary())
    print(f"wrote {out} (load it with mlx_lm.load or --model {out})")
    return 0
