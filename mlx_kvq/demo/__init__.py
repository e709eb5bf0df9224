"""The embedded demo models, loadable offline, and their evaluation texts.

Two models, named on every command line as ``--model demo:NAME``:

- ``demo:gemma`` (the default when no ``--model`` is given): a hybrid-attention
  ``gemma3_text`` (sliding windows and full attention) trained on the KJV;
- ``demo:full``: a ``qwen3`` with full attention on every layer and q/k norms,
  trained on the docstrings of CPython's standard library (modern English).

``demo_model_path(name)`` is a directory that ``mlx_lm.load`` reads with no
network. The texts: ``heldout_path()``, KJV books the gemma model never saw,
and ``modern_path()``, prose of the Python Language Reference (PSF License,
``PYTHON-DOCS-LICENSE.txt``) that neither model saw; ``demo_texts(name)``
lists them in-domain first for that model. See ``README.md`` next to this
file for how they were made (``scripts/train_demo.py``,
``scripts/make_modern_text.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEMO_DIR",
    "DEMO_FULL_DIR",
    "DEMO_HELDOUT",
    "DEMO_MODEL_DIR",
    "DEMO_MODERN",
    "DEMO_MODELS",
    "DEMO_PREFIX",
    "DemoModel",
    "demo_model_path",
    "demo_name",
    "demo_texts",
    "heldout_path",
    "modern_path",
    "resolve_model",
]

DEMO_DIR = Path(__file__).resolve().parent
DEMO_MODEL_DIR = DEMO_DIR / "model"
DEMO_HELDOUT = DEMO_DIR / "heldout.txt"
DEMO_FULL_DIR = DEMO_DIR / "full"
DEMO_MODERN = DEMO_DIR / "modern.txt"
DEMO_PREFIX = "demo:"


@dataclass(frozen=True)
class DemoModel:
    """One embedded model: its directory, the id it is served under, and its
    evaluation texts by name, in-domain first."""

    directory: Path
    served_id: str
    texts: tuple[str, ...]


DEMO_MODELS = {
    "gemma": DemoModel(DEMO_MODEL_DIR, "mlx-kvq-demo", ("heldout", "modern")),
    "full": DemoModel(DEMO_FULL_DIR, "mlx-kvq-demo-full", ("modern", "heldout")),
}
DEFAULT_DEMO = "gemma"


def _model(name: str) -> DemoModel:
    if name not in DEMO_MODELS:
        known = ", ".join(DEMO_PREFIX + n for n in DEMO_MODELS)
        raise ValueError(f"unknown demo model {DEMO_PREFIX}{name}: the known ones are {known}")
    return DEMO_MODELS[name]


def demo_model_path(name: str = DEFAULT_DEMO) -> Path:
    """Directory of a demo model (config, weights, tokenizer) for ``mlx_lm.load``.

    Raises FileNotFoundError when the installation does not ship the model files.
    """
    directory = _model(name).directory
    if not (directory / "config.json").is_file():
        raise FileNotFoundError(f"demo model files are missing from {directory}")
    return directory


def resolve_model(model: str | None) -> tuple[str, str | None]:
    """``--model`` as (what ``mlx_lm.load`` takes, the demo model's served id):
    no model or ``demo:NAME`` is an embedded model; anything else is passed
    on unchanged, with no served id of its own."""
    if model is None:
        model = DEMO_PREFIX + DEFAULT_DEMO
    if not model.startswith(DEMO_PREFIX):
        return model, None
    name = model[len(DEMO_PREFIX) :]
    return str(demo_model_path(name)), _model(name).served_id


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


def demo_texts(name: str = DEFAULT_DEMO) -> dict[str, Path]:
    """A demo model's evaluation texts by name: in-domain first."""
    paths = {"heldout": heldout_path, "modern": modern_path}
    return {text: paths[text]() for text in _model(name).texts}


def demo_name(model: str | None) -> str | None:
    """The demo model ``--model`` names (None for any other model)."""
    if model is None:
        return DEFAULT_DEMO
    if model.startswith(DEMO_PREFIX):
        _model(model[len(DEMO_PREFIX) :])
        return model[len(DEMO_PREFIX) :]
    return None
