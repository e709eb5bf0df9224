"""`--draft-model`, `--num-draft-tokens` and the request fields.

A real `mlx-kvq serve` with the official `openai` client: a scripted hybrid
model (windows of 16 tokens that wrap) drafted by the same script with one
step changed, default (quantized) KV caches on both. Requests are decoded
speculatively and say the script, streamed or not; `draft_model` and
`num_draft_tokens` are honoured as mlx_lm.server reads them or refused with
a 400 naming the field; `/health` shows the draft model and the warm-up
through the speculative path; `/metrics` counts drafts. Draft models that
cannot serve are refused at startup with exit status 2 and the reason.
"""

from __future__ import annotations

import httpx
import pytest
from kvq_testing.scripted import Reply, save_scripted_model
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model

from mlx_kvq.commands import main

PIECES = [f"w{i:02d} " for i in range(10)]
ANSWER = "".join(PIECES)
QUESTION = [{"role": "user", "content": "Lorem ipsum dolor sit amet. " * 3 + "Tell the story."}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    model = save_scripted_model(root / "model", {"story": PIECES}, arch="hybrid")
    wrong = Reply(PIECES, extra={("w03 ", "w06 "): 25.0})
    draft = save_scripted_model(root / "draft", {"story": wrong}, arch="hybrid")
    return model, draft, root


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def test_draft_model_serves_requests_speculatively(paths):
    model, draft, _ = paths
    with ServerProcess(model, "--draft-model", str(draft), "--num-draft-tokens", "4") as server:
        health = server.wait_ready().json()
        assert health["draft_model"]["model"] == str(draft)
        assert health["draft_model"]["num_draft_tokens"] == 4
        warm = health["warmup"]["speculative"]
        assert warm["generated"] >= 4 * 5 and warm["prompt_tokens"] > 16
        assert all(s["quantized"] == s["slots"] for s in warm["draft"].values())

        client = server.client()
        r = client.chat.completions.create(model="default_model", messages=QUESTION)
        assert r.choices[0].message.content == ANSWER
        stream = client.chat.completions.create(
            model="default_model", messages=QUESTION, stream=True,
            extra_body={"draft_model": str(draft), "num_draft_tokens": 2},
        )  # fmt: skip
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ANSWER
        r = client.completions.create(
            model="default_model", prompt="story", max_tokens=20,
            extra_body={"draft_model": "default_model"},
        )  # fmt: skip
        assert r.choices[0].text == ANSWER
        # draft_model: null and num_draft_tokens: 0 decode without drafting
        for extra in ({"draft_model": None}, {"num_draft_tokens": 0}):
            r = client.chat.completions.create(
                model="default_model", messages=QUESTION, extra_body=extra
            )
            assert r.choices[0].message.content == ANSWER
        m = server.metrics()
        assert m['mlx_kvq_draft_requests_total{served="speculative"}'] == 3
        assert m.get('mlx_kvq_draft_requests_total{served="batch"}', 0) == 0
        accepted = m["mlx_kvq_draft_tokens_accepted_total"]
        assert 0 < accepted < m["mlx_kvq_draft_tokens_proposed_total"]

        for body, param in (
            ({"draft_model": str(draft.parent / "other")}, "draft_model"),
            ({"num_draft_tokens": 65}, "num_draft_tokens"),
            ({"num_draft_tokens": "3"}, "num_draft_tokens"),
            ({"adapters": "some/adapter"}, "adapters"),
        ):
            r = post(server, "/v1/chat/completions", {"messages": QUESTION, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == param


def test_without_draft_model_the_fields_are_refused(paths, tmp_path):
    """Checked on the request schema and the server's settings, without a process."""
    from mlx_kvq.server.openai import schemas
    from mlx_kvq.server.openai.variants import VariantError, draft_tokens
    from mlx_kvq.server.settings import ServerSettings

    plain = ServerSettings(model_id="m")
    drafting = ServerSettings(model_id="m", draft_model="/d", num_draft_tokens=5)

    def body(**fields):
        return schemas.ChatCompletionRequest.model_validate({"messages": QUESTION, **fields})

    assert draft_tokens(body(), plain) == 0
    assert draft_tokens(body(num_draft_tokens=0), plain) == 0
    for fields, param in (
        ({"draft_model": "/d"}, "draft_model"),
        ({"num_draft_tokens": 2}, "num_draft_tokens"),
    ):
        with pytest.raises(VariantError) as e:
            draft_tokens(body(**fields), plain)
        assert e.value.param == param and "--draft-model" in e.value.message
    assert draft_tokens(body(), drafting) == 5
    assert draft_tokens(body(draft_model="default_model", num_draft_tokens=2), drafting) == 2
    assert draft_tokens(body(draft_model="/d/"), drafting) == 5
    with pytest.raises(VariantError) as e:  # a NUL byte names no path (was a ValueError: 500)
        draft_tokens(body(draft_model="/d\x00"), drafting)
    assert e.value.param == "draft_model"
    assert draft_tokens(body(draft_model=None), drafting) == 0
    with pytest.raises(VariantError):
        draft_tokens(body(draft_model="/e"), drafting)


def test_draft_models_that_cannot_serve_exit_2(paths, tmp_path, capsys):
    model, draft, root = paths
    other_vocab = save_tiny_model(tmp_path / "llama", "llama")
    recurrent = save_tiny_model(tmp_path / "recurrent", "lfm2")
    shared = save_tiny_model(tmp_path / "shared", "gemma4_text:kv_shared")
    cases = (
        (model, other_vocab, "the draft model must use the model's tokenizer"),
        (recurrent, other_vocab, "a recurrent state cannot be rewound"),
        (shared, other_vocab, "(KV-shared layers)"),
        (model, tmp_path / "missing", "could not load the draft model"),
    )
    for target, drafter, message in cases:
        rc = main(["serve", "--model", str(target), "--draft-model", str(drafter)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err
    rc = main(["serve", "--model", str(model), "--draft-model", str(draft),
               "--num-draft-tokens", "0"])  # fmt: skip
    assert rc == 2 and "--num-draft-tokens must be in [1, 64]" in capsys.readouterr().err
    rc = main(["serve", "--model", str(model), "--num-draft-tokens", "4"])
    assert rc == 2 and "--num-draft-tokens needs --draft-model" in capsys.readouterr().err
