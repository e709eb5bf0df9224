"""The command line: `mlx-kvq serve | generate | plan | cache-prompt | eval | bench | convert`.

Every entry point lives here: argparse, startup and exit codes, for single
processes and `mlx.launch` groups alike. Flags that several commands take
are defined once (`flags.py`). A command raises on a setting it cannot
honour; `main` prints the message and exits with status 2, before any
weights are loaded wherever the config alone decides it.

Every command runs MLX's float products on a fast BLAS (`use_fast_blas`,
OpenBLAS on Linux): the program decides that here, once, since importing
`mlx_kvq` leaves the process's BLAS alone.
"""

from __future__ import annotations

import argparse
import sys

from ..blas import use_fast_blas
from . import bench, cache_prompt, convert, generate, plan, serve
from . import eval as eval_command

EXIT_BAD_SETTING = 2
COMMANDS = (serve, generate, plan, cache_prompt, eval_command, bench, convert)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-kvq", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # as given, for reports that record their command
    try:
        use_fast_blas()  # a BlasError (bad MLX_KVQ_BLAS) is a ValueError: exit 2
        return int(args.run(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # UnsupportedKVConfig is a ValueError
        print(f"mlx-kvq {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_SETTING
