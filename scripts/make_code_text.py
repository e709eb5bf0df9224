"""Write the source-code evaluation text of docs/quality.md: Python's own code.

    python scripts/make_code_text.py /tmp/stdlib-code.txt

The real models are judged on two texts: English (the GPL-3, which Debian
ships as /usr/share/common-licenses/GPL-3) and source code. The code is three
modules of the Python standard library that runs this script (`fractions`,
`heapq`, `textwrap`, PSF License; about 71,000 characters with CPython
3.11.7), concatenated in that order, each preceded by a `# file: NAME` line.
Other Python versions ship slightly different files, so the docs name the
version their numbers were made with.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

MODULES = ("fractions", "heapq", "textwrap")


def code_text() -> str:
    lib = Path(sysconfig.get_paths()["stdlib"])
    parts = [f"# file: {name}.py\n" + (lib / f"{name}.py").read_text() for name in MODULES]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    text = code_text()
    Path(argv[0]).write_text(text)
    print(f"wrote {argv[0]}: {len(text)} characters, Python {sys.version.split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
