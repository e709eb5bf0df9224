"""Write mlx_kvq/demo/modern.txt, the out-of-domain evaluation text.

    python scripts/make_modern_text.py      # CPython 3.11's pydoc_data

The demo model was trained on the King James Bible; its held-out text is more
of the same. This second text is modern technical English: prose sections
of the Python Language Reference, as shipped inside CPython's standard
library (`pydoc_data.topics`, the text `help()` shows), so it is on every
machine that has Python, no download needed. Code examples (indented
blocks), grammar rules (`::=` lines) and heading underlines are dropped;
everything else is kept in the order below.

Licence: the Python documentation is distributed under the PSF License
Agreement (version 2), which allows derivative works provided the licence
and PSF's copyright notice are retained and the changes summarised: see
mlx_kvq/demo/PYTHON-DOCS-LICENSE.txt, which this script also writes. The
file shipped in the package was made with CPython 3.11.7; other versions'
topics differ slightly, so run this only to regenerate it on purpose.
"""

from __future__ import annotations

import pydoc_data.topics
import re
import sys
import textwrap
from pathlib import Path

DEMO = Path(__file__).resolve().parents[1] / "mlx_kvq" / "demo"
TOPICS = (
    "naming", "execmodel", "import", "exceptions", "objects", "types", "customization",
    "attribute-access", "compound", "assignment", "comparisons", "calls", "function",
    "class", "try", "with", "raise", "async",
)  # fmt: skip
CHANGES = (
    "Changes (PSF License clause 3): mlx_kvq/demo/modern.txt is an excerpt of the\n"
    "Python Language Reference topics in CPython {version}'s pydoc_data/topics.py\n"
    "{topics}\n"
    "with indented code examples, grammar rules and heading underlines removed\n"
    "and runs of blank lines collapsed. It is used only as evaluation text by\n"
    "`mlx-kvq eval`. Made by scripts/make_modern_text.py.\n"
    "The weights in mlx_kvq/demo/full/ are a language model trained on the\n"
    "docstrings of CPython {version}'s standard library and its other pydoc_data\n"
    "topics (scripts/train_demo.py --model full); none of that text is shipped.\n"
)


def prose(text: str) -> str:
    lines = []
    for line in text.splitlines():
        s = line.rstrip()
        if s.startswith("   ") or "::=" in s:
            continue
        if s.strip() and set(s.strip()) <= set("*=-~^"):
            continue
        lines.append(s)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def psf_license() -> str:
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}"
    src = (lib / "LICENSE.txt").read_text()
    start = src.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = src.index("BEOPEN.COM LICENSE AGREEMENT")
    return src[start:end].rstrip() + "\n"


def main() -> int:
    topics = pydoc_data.topics.topics
    text = "\n\n".join(prose(topics[t]) for t in TOPICS) + "\n"
    (DEMO / "modern.txt").write_text(text)
    version = sys.version.split()[0]
    listed = textwrap.fill("(topics: " + ", ".join(TOPICS) + "),", width=78)
    notice = CHANGES.format(version=version, topics=listed)
    (DEMO / "PYTHON-DOCS-LICENSE.txt").write_text(notice + "\n" + psf_license())
    print(f"modern.txt: {len(text)} characters from CPython {version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
