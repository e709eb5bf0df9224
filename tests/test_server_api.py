"""The real `mlx-kvq serve` process, spoken to with the official openai client.

One server per module (a tiny hybrid llama with sliding and full layers,
4-bit KV): chat and text completions, streaming and not, usage counts
checked against the model's own tokenizer, stop strings, logprobs, seeds,
model names, and prompt-cache reuse across the turns of a conversation.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from kvq_testing.server import ServerProcess
from kvq_testing.tiny import save_tiny_model
from mlx_lm.utils import load_tokenizer

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("api") / "tiny-hybrid", "llama:sliding")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess(model_dir, "--max-tokens", "24", "--prompt-cache-size", "32",
                       api_key="sk-api-test") as s:  # fmt: skip
        s.wait_ready()
        yield s


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_prompt_len(tokenizer, messages):
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def check_usage(usage, prompt_tokens, finish_reason, counted_tokens, max_tokens=MAX_TOKENS):
    """Usage matches the prompt and the tokens the response carried (EOS counted, not shown)."""
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finish_reason == "length":
        assert usage.completion_tokens == max_tokens == counted_tokens
    else:
        assert finish_reason == "stop"
        assert counted_tokens <= usage.completion_tokens <= counted_tokens + 1


MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Tell me about the river and the old bridge."},
]


def test_models_lists_the_served_model(client, model_dir):
    ids = [m.id for m in client.models.list().data]
    assert ids == [str(model_dir)]


def test_chat_non_streaming(client, tokenizer):
    r = client.chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    content = choice.logprobs.content
    assert all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)
    check_usage(r.usage, chat_prompt_len(tokenizer, MESSAGES), choice.finish_reason, len(content))


def test_chat_streaming(client, tokenizer):
    stream = client.chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True}, logprobs=True,
    )  # fmt: skip
    text, tokens, reason, usage = "", 0, None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                tokens += len(c.logprobs.content)
            reason = c.finish_reason or reason
    assert usage is not None and reason in ("stop", "length")
    check_usage(usage, chat_prompt_len(tokenizer, MESSAGES), reason, tokens)
    same = client.chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS
    )
    assert same.choices[0].message.content == text  # greedy: same text either way


def test_text_completion_non_streaming_and_streaming(client, tokenizer):
    prompt = "Once upon a time there was a little robot"
    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS,
                                  logprobs=2)  # fmt: skip
    choice = r.choices[0]
    assert r.object == "text_completion"
    assert all(len(t) <= 2 for t in choice.logprobs.top_logprobs)
    check_usage(r.usage, len(tokenizer.encode(prompt)), choice.finish_reason,
                len(choice.logprobs.tokens))  # fmt: skip

    text, usage, reason = "", None, None
    for chunk in client.completions.create(
        model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
        stream_options={"include_usage": True},
    ):  # fmt: skip
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    assert text == choice.text and reason == choice.finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens


def test_stop_strings_are_honoured(client):
    prompt = "The teacher asked the students to read"
    free = client.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS,
                                     logprobs=0)  # fmt: skip
    pieces = [t for t in free.choices[0].logprobs.tokens if t.strip() and "\ufffd" not in t]
    if not pieces:
        pytest.skip("the random model produced no printable token to stop on")
    stop = pieces[len(pieces) // 2]
    full = free.choices[0].text
    expected = full[: full.find(stop)]

    r = client.completions.create(model="default_model", prompt=prompt, max_tokens=MAX_TOKENS,
                                  stop=[stop])  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == expected

    streamed, reason = "", None
    for chunk in client.completions.create(
        model="default_model", prompt=prompt, max_tokens=MAX_TOKENS, stop=stop, stream=True
    ):
        for c in chunk.choices:
            streamed += c.text
            reason = c.finish_reason or reason
    assert streamed == expected and reason == "stop"

    chat = client.chat.completions.create(
        model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, stop=["e", "a", "o"]
    )
    text = chat.choices[0].message.content
    assert not any(s in text for s in "eao")


def test_model_name_served_id_and_alias(client, model_dir):
    for name in (str(model_dir), "default_model"):
        r = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
        assert r.model == str(model_dir)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0)
    a = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kw).choices[0].message.content
    assert a == b


def test_conversation_turns_reuse_the_prompt_cache(client, tokenizer, server):
    messages = [{"role": "user", "content": "Hello, how are you today?"}]
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model="default_model", messages=messages,
                                           max_tokens=6)  # fmt: skip
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.usage.prompt_tokens == chat_prompt_len(tokenizer, messages)
        messages = messages + [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"Tell me more, part {turn}."},
        ]
    # Turns 2 and 3 start with the previous turn's whole prompt, cached when
    # that prompt was processed: at least that much is reused.
    assert cached[1] > 0 and cached[2] > cached[1]
    m = server.metrics()
    assert m["mlx_kvq_prompt_cache_hits_total"] >= 2
    assert m["mlx_kvq_prompt_cache_entries"] > 0


def test_api_key_flag_guards_v1_only(server):
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=server.headers(), timeout=10).is_success
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_metrics_are_prometheus_text(server):
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = server.metrics()
    for name in (
        'mlx_kvq_kv_bytes{kind="full"}', 'mlx_kvq_kv_bytes{kind="sliding"}',
        "mlx_kvq_kv_layers_quantized_fraction", "mlx_kvq_prompt_cache_bytes",
        "mlx_kvq_prompt_cache_entries", 'mlx_kvq_requests_total{status="ok"}',
        "mlx_kvq_queue_depth", "mlx_kvq_batch_size", "mlx_kvq_batch_size_max",
        "mlx_kvq_prompt_tokens_per_second", "mlx_kvq_generation_tokens_per_second",
    ):  # fmt: skip
        assert name in m, name
    assert m["mlx_kvq_kv_layers_quantized_fraction"] == 1.0
    assert m['mlx_kvq_requests_total{status="ok"}'] > 0
