"""The embedded demo model: a small hybrid-attention ``gemma3_text`` trained on the KJV.

``demo_model_path()`` is a directory that ``mlx_lm.load`` reads with no network;
``heldout_path()`` is English text the model never saw in training, for evaluation,
and ``modern_path()`` an out-of-domain one (modern technical English: prose of
the Python Language Reference, PSF License, ``PYTHON-DOCS-LICENSE.txt``).
See ``README.md`` next to this file for how they were made (``scripts/train_demo.py``,
``scripts/make_modern_text.py``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DEMO_DIR",
    "DEMO_HELDOUT",
    "DEMO_MODEL_DIR",
    "DEMO_MODERN",
    "demo_model_path",
    "demo_texts",
    "heldout_path",
    "modern_path",
]

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_HELDOUT = DEMO_DIR / "heldout.txt"
DEMO_MODERN = DEMO_DIR / "modern.txt"


def demo_model_path() -> Path:
    """Directory of the demo model (config, weights, tokenizer) for ``mlx_lm.load``.

    Raises FileNotFoundError when the installation does not ship the model files.
    """
    if not (DEMO_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"demo model files are missing from {DEMO_MODEL_DIR}")
    return DEMO_MODEL_DIR


def heldout_path() -> Path:
    """Held-out KJV text (books never used in training), one verse per line."""
    if not DEMO_HELDOUT.is_file():
        raise FileNotFoundError(f"demo held-out text is missing: {DEMO_HELDOUT}")
    return DEMO_HELDOUT


def modern_path() -> Path:
    """Out-of-domain evaluation text: modern technical English (Python docs)."""
    if not DEMO_MODERN.is_file():
        raise FileNotFoundError(f"demo out-of-domain text is missing: {DEMO_MODERN}")
    return DEMO_MODERN


def demo_texts() -> dict[str, Path]:
    """The demo model's evaluation texts by name: in-domain first."""
    return {"heldout": heldout_path(), "modern": modern_path()}
