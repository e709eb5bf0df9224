"""Run the architecture sweep and write docs/architectures.md.

python scripts/arch_sweep.py [--only NAME ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # kvq_testing

from kvq_testing import archs  # noqa: E402
from kvq_testing.sweep import SUPPORTED, markdown, sweep_one  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument(
        "--out", default=str(Path(__file__).parent.parent / "docs" / "architectures.md")
    )
    args = parser.parse_args()
    names = args.only or list(archs.TINY_CONFIGS)
    results = []
    for name in names:
        r = sweep_one(name)
        results.append(r)
        print(
            f"{name:<28} {r.verdict:<24} {r.kinds:<40} {r.seconds:5.1f}s {r.reason[:120]}",
            flush=True,
        )
    if not args.only:
        Path(args.out).write_text(markdown(results, archs.SKIPPED))
        print(f"wrote {args.out}")
    return 0 if all(r.verdict == SUPPORTED or "refused" in r.verdict for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
