"""`mlx-kvq serve` takes what mlx_lm.server 0.32.2 takes, read from the sources.

Flags: every flag of mlx_lm.server's own argument parser is a flag of
`mlx-kvq serve --help`, with the same default unless a documented
difference says why. Request fields: every field of OpenAI's two requests
(the `openai` client's typed parameters) and every field mlx_lm.server
reads from a body is declared by `schemas.py` with a treatment in
`fields.py`, and `docs/server.md` lists each with that treatment.
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path
from unittest import mock

import mlx_lm.server
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from mlx_kvq.commands import build_parser
from mlx_kvq.server.fields import FIELDS, Treatment
from mlx_kvq.server.openai.schemas import ChatCompletionRequest, CompletionRequest

DOCS = Path(__file__).resolve().parents[1] / "docs" / "server.md"
# Defaults that differ on purpose (docs/server.md, "Flags").
DIFFERENT_DEFAULTS = {
    "quantized_kv_start": "ours quantizes from token 0; mlx-lm's default is 5000",
    "num_draft_tokens": "ours is None (3 with --draft-model; alone it exits 2); mlx-lm's is 3",
    "allowed_origins": "ours is none besides the server's own and loopback origins; mlx-lm's "
    "is * (any web page may drive a local server)",
}


class _Captured(Exception):
    pass


def mlx_lm_parser() -> argparse.ArgumentParser:
    """The parser mlx_lm.server.main builds (caught as it starts parsing)."""

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            mlx_lm.server.main()
        except _Captured as e:
            return e.args[0]
    raise AssertionError("mlx_lm.server.main did not parse arguments")


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def flags(parser: argparse.ArgumentParser) -> set[str]:
    """The long flags a parser's --help lists (from its actions: the help
    text wraps long flag names at their hyphens)."""
    return {
        o
        for a in parser._actions
        if a.help != argparse.SUPPRESS
        for o in a.option_strings
        if o.startswith("--")
    } - {"--help"}


def test_every_mlx_lm_server_flag_is_a_serve_flag():
    theirs, ours = flags(mlx_lm_parser()), flags(serve_parser())
    assert len(theirs) > 20  # the capture found the real parser
    assert {"--adapter-path", "--draft-model", "--num-draft-tokens"} <= theirs
    missing = sorted(theirs - ours)
    assert not missing, f"mlx_lm.server flags mlx-kvq serve lacks: {missing}"


def test_shared_flags_have_mlx_lm_server_defaults():
    theirs = vars(mlx_lm_parser().parse_args([]))
    ours = vars(build_parser().parse_args(["serve"]))
    different = {
        name: (theirs[name], ours[name])
        for name in theirs.keys() & ours.keys()
        if theirs[name] != ours[name] and name not in DIFFERENT_DEFAULTS
    }
    assert not different, different


def openai_fields(params: type) -> set[str]:
    return set(typing.get_type_hints(params)) | {"stream"}


def mlx_lm_body_fields() -> set[str]:
    """The fields mlx_lm.server reads from a request body (from its source)."""
    source = Path(mlx_lm.server.__file__).read_text()
    return set(re.findall(r"body(?:\.get\(|\[)\s*\"(\w+)\"", source))


def declared(model: type) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


@pytest.mark.parametrize(
    ("endpoint", "model", "params"),
    [
        ("chat", ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase),
        ("completions", CompletionRequest, completion_create_params.CompletionCreateParamsBase),
    ],
)
def test_every_field_is_declared_with_a_treatment(endpoint, model, params):
    fields = FIELDS[endpoint]
    assert declared(model) == set(fields)
    assert not openai_fields(params) - set(fields), "OpenAI fields without a treatment"
    mlx_lm_fields = mlx_lm_body_fields()
    assert {"repetition_penalty", "xtc_threshold", "adapters", "messages"} <= mlx_lm_fields
    chat_only = {"messages", "tools", "role_mapping", "chat_template_kwargs"}
    wanted = mlx_lm_fields - (chat_only if endpoint == "completions" else {"prompt"})
    assert not wanted - set(fields), "mlx_lm.server fields without a treatment"


def docs_table(heading: str) -> dict[str, str]:
    """field -> its row, from the table under `heading` in docs/server.md."""
    text = DOCS.read_text()
    start = text.index(heading)
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if rows and not line.startswith("|"):
            break
        m = re.match(r"\|\s*`(\w+)`\s*\|", line)
        if m:
            rows[m.group(1)] = line
    return rows


@pytest.mark.parametrize(
    ("endpoint", "heading"),
    [
        ("chat", "### `POST /v1/chat/completions` fields"),
        ("completions", "### `POST /v1/completions` fields"),
    ],
)
def test_docs_list_every_field_with_its_treatment(endpoint, heading):
    rows = docs_table(heading)
    assert set(rows) == set(FIELDS[endpoint])
    words = {Treatment.HONOURED: "honoured", Treatment.REFUSED: "400", Treatment.IGNORED: "ignored"}
    for name, doc in FIELDS[endpoint].items():
        treatment = rows[name].split("|")[-2].strip()
        assert treatment.startswith(words[doc.treatment]), (name, treatment)


def test_docs_list_every_flag():
    text = DOCS.read_text()
    section = text[text.index("## Flags") :]
    missing = sorted(f for f in flags(serve_parser()) if f"`{f}`" not in section)
    assert not missing, f"flags docs/server.md does not list: {missing}"
