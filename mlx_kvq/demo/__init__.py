"""The embedded demo model: a small hybrid-attention ``gemma3_text`` trained on the KJV.

``demo_model_path()`` is a directory that ``mlx_lm.load`` reads with no network;
``heldout_path()`` is English text the model never saw in training, for evaluation.
See ``README.md`` next to this file for how both were made (``scripts/train_demo.py``).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["DEMO_DIR", "DEMO_HELDOUT", "DEMO_MODEL_DIR", "demo_model_path", "heldout_path"]

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_HELDOUT = DEMO_DIR / "heldout.txt"


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
