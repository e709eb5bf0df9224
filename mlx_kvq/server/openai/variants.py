"""Request fields that name a variant of the served model: `adapters`,
`draft_model` and `num_draft_tokens` (mlx_lm.server's extras).

mlx_lm.server loads whatever a request names (and, for `model:
"default_model"`, silently uses its `--adapter-path` whatever `adapters`
says). This server holds one model, loaded with its adapter and draft model
before the warm-up: a request naming what is loaded is served with it, one
naming anything else is a 400 that says what is loaded. The base model
never answers a request meant for an adapter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..settings import DEFAULT_MODEL_ALIAS, ServerSettings


@dataclass(frozen=True)
class VariantError(Exception):
    """A request field naming something this server does not hold."""

    message: str
    param: str


def same_path(a: str, b: str) -> bool:
    """Whether two adapter or model paths name the same place."""
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # ValueError: a NUL byte in the path
        return False


def check_adapter(body: Any, settings: ServerSettings) -> None:
    """`adapters` must be absent, null, or the loaded adapter."""
    asked = body.adapters
    if asked is None:
        return
    loaded = settings.adapter_path
    if loaded is None:
        raise VariantError(
            f"adapters '{asked}' asked for, but this server serves '{settings.model_id}' "
            "without an adapter and does not load adapters per request; start it with "
            f"--adapter-path {asked}",
            "adapters",
        )
    if not same_path(asked, loaded):
        raise VariantError(
            f"adapters '{asked}' asked for, but this server serves '{settings.model_id}' "
            f"with the adapter '{loaded}' and does not load others per request",
            "adapters",
        )


def draft_tokens(body: Any, settings: ServerSettings) -> int:
    """Tokens to draft per step for this request; 0 decodes without drafting.

    As in mlx_lm.server, a request uses the server's draft model unless it
    says otherwise: `draft_model` absent, `"default_model"` or the loaded
    draft model's path speculates with `num_draft_tokens` (default
    `--num-draft-tokens`); `draft_model: null` or `num_draft_tokens: 0`
    decodes without drafting. Naming another draft model, or asking for
    drafting from a server without `--draft-model`, is a 400.
    """
    fields = body.model_fields_set
    loaded = settings.draft_model
    named = body.draft_model
    if loaded is None:
        if named is not None:
            raise VariantError(
                f"draft_model '{named}' asked for, but this server has no draft model; "
                f"start it with --draft-model {named}",
                "draft_model",
            )
        if body.num_draft_tokens:
            raise VariantError(
                "num_draft_tokens needs a draft model, and this server has none "
                "(start it with --draft-model)",
                "num_draft_tokens",
            )
        return 0
    if "draft_model" in fields and named is None:
        return 0
    if named is not None and named != DEFAULT_MODEL_ALIAS and not same_path(named, loaded):
        raise VariantError(
            f"draft_model '{named}' asked for, but this server drafts with '{loaded}' "
            "and does not load others per request",
            "draft_model",
        )
    if body.num_draft_tokens is None:
        return settings.num_draft_tokens
    return body.num_draft_tokens
