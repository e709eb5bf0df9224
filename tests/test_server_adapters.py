"""`--adapter-path` and the `adapters` request field.

A tiny LoRA made with mlx-lm's own LoRA utilities and saved as `mlx_lm.lora`
saves it (kvq_testing.adapters) changes the scripted model's answer (it
no longer stops after the script). `mlx-kvq serve --adapter-path` answers
with the adapter, as `mlx_lm.server --adapter-path` does for the same
request; a request's `adapters` naming the loaded adapter is served, one
naming another adapter (or any adapter, on a server without one) is a 400
naming the field: the base model never answers in silence (the field
against what a server holds is checked without a server process).
"""

from __future__ import annotations

import httpx
import pytest
from kvq_testing.adapters import save_lora_adapter
from kvq_testing.scripted import save_scripted_model
from kvq_testing.server import MlxLmServerProcess, ServerProcess

from mlx_kvq.commands import main
from mlx_kvq.server.openai import schemas
from mlx_kvq.server.openai.variants import VariantError, check_adapter
from mlx_kvq.server.settings import ServerSettings

ANSWER = "Paris is the capital of France."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    model = save_scripted_model(root / "model", {"capital": [ANSWER]}, arch="llama")
    return model, save_lora_adapter(model, root / "adapter")


def ask(server, **extra):
    return server.client().chat.completions.create(
        model="default_model", messages=QUESTION, max_tokens=MAX_TOKENS, extra_body=extra or None
    )


def test_adapter_answers_as_in_mlx_lm_server_and_adapters_field(model_and_adapter):
    model, adapter = model_and_adapter
    with MlxLmServerProcess(model, "--adapter-path", str(adapter)) as reference:
        reference.wait_ready()
        expected = ask(reference).choices[0].message.content
    assert expected != ANSWER and expected.startswith(ANSWER)  # the LoRA changed the answer

    with ServerProcess(model, "--adapter-path", str(adapter)) as server:
        server.wait_ready()
        assert ask(server).choices[0].message.content == expected
        # naming the loaded adapter (as given, or another spelling of the path)
        for name in (str(adapter), str(adapter) + "/", str(adapter / ".." / adapter.name)):
            assert ask(server, adapters=name).choices[0].message.content == expected
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": QUESTION, "adapters": str(adapter.parent / "other")},
            timeout=30,
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "adapters" and str(adapter) in err["message"]
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "capital", "adapters": 3},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "adapters"
        # a NUL byte cannot name a path: a 400, not a 500 from the path resolution
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={"messages": QUESTION, "adapters": str(adapter) + "\u0000x"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "adapters"


def chat_body(**fields):
    return schemas.ChatCompletionRequest.model_validate({"messages": QUESTION, **fields})


def test_adapters_field_against_what_the_server_holds():
    plain = ServerSettings(model_id="m")
    with_adapter = ServerSettings(model_id="m", adapter_path="/srv/adapters/a")
    for settings in (plain, with_adapter):
        check_adapter(chat_body(), settings)
        check_adapter(chat_body(adapters=None), settings)
    check_adapter(chat_body(adapters="/srv/adapters/a/"), with_adapter)
    check_adapter(chat_body(adapters="/srv/adapters/b/../a"), with_adapter)
    with pytest.raises(VariantError) as e:
        check_adapter(chat_body(adapters="/srv/adapters/a"), plain)
    assert e.value.param == "adapters" and "--adapter-path /srv/adapters/a" in e.value.message
    with pytest.raises(VariantError) as e:
        check_adapter(chat_body(adapters="/srv/adapters/b"), with_adapter)
    assert e.value.param == "adapters" and "'/srv/adapters/a'" in e.value.message
    with pytest.raises(VariantError) as e:
        check_adapter(chat_body(adapters="/srv/adapters/a\x00"), with_adapter)
    assert e.value.param == "adapters"


def test_missing_adapter_exits_2_before_loading(tmp_path, model_and_adapter, capsys):
    model, _ = model_and_adapter
    rc = main(["serve", "--model", str(model), "--adapter-path", str(tmp_path / "none")])
    assert rc == 2
    assert "adapter_config.json" in capsys.readouterr().err
