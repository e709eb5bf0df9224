"""`mlx-kvq convert FILE.gguf OUT_DIR`: a GGUF file as an mlx-lm directory to keep."""

from __future__ import annotations

import argparse
from pathlib import Path

from .flags import add_convert_flags


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="write an mlx-lm directory (config, weights, tokenizer) from a GGUF file",
    )
    add_convert_flags(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..from_gguf import check, convert, is_gguf

    if not Path(args.gguf).is_file():
        raise FileNotFoundError(f"no GGUF file at {args.gguf}")
    if not is_gguf(args.gguf):
        raise ValueError(f"{args.gguf} is not a GGUF file (no GGUF magic number)")
    out = Path(args.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory")
    check(args.gguf)
    conversion = convert(args.gguf, out, args.dtype, dequantize_all=args.dequantize)
    print(conversion.summary())
    print(f"wrote {out} (load it with mlx_lm.load or --model {out})")
    return 0
