"""The real models, from their GGUF files: Gemma 3 270M (the seed's hybrid
family) and SmolLM2-135M-Instruct (llama), converted as `--model FILE.gguf`
converts them (tests/kvq_testing/real_models.py).

What a correct conversion shows: sensible greedy answers, perplexity in the
range of models this size on English text, tokenizers that round-trip; and
the product on real weights: the seed's scenario on Gemma 3 (every layer
quantized, the sliding layers' bytes flat past the 512-token window, ready
only after the warm-up, a generic-format tool call), a chat through the
official SDKs, and the paged layout against padded rows.
"""

from __future__ import annotations

import inspect
import json
import math

import anthropic
import mlx.core as mx
import numpy as np
import pytest
from kvq_testing import real_models
from kvq_testing.server import ServerProcess
from mlx_lm.generate import BatchGenerator

from mlx_kvq.caches import Pages, page_caches
from mlx_kvq.config import AUTO_BLOCK_SIZE, is_split
from mlx_kvq.defaults import default_kv_config
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.from_gguf import read_conversion
from mlx_kvq.plan import has_bounded_layers, plan_kv

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _text(n_chars: int) -> str:
    if real_models.GPL3.is_file():
        return real_models.GPL3.read_text()[:n_chars]
    return inspect.getsource(json)[:n_chars]  # Python's own source (PSF licence)


def _corpus() -> list[str]:
    return [
        _text(6000),
        inspect.getsource(inspect)[:6000],
        "naïve café — 東京 🙂\t\ttabs\n\n\n  two spaces, Ünïcödé, 123456789, <b>tags</b>",
    ]


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_tokenizer_round_trips_on_a_corpus(name):
    _, tok = real_models.loaded(name)
    for i, text in enumerate(_corpus()):
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        if i < 2:  # English and Python: merges happened, not bytes or characters
            assert len(ids) < len(text) / 3


def test_smollm_weights_are_the_files_size_and_it_answers():
    directory = real_models.converted("smollm")
    conversion = read_conversion(directory)
    assert set(conversion.treatments) == {"Q4_1", "Q8_0", "F32"}
    assert conversion.treatments["Q4_1"] == {"packed": 210}
    assert conversion.ratio <= 1.15
    model, tok = real_models.loaded("smollm")
    from mlx_lm import generate

    prompt = tok.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    assert "Paris" in generate(model, tok, prompt, max_tokens=12)


def test_gemma_base_model_completes_code():
    model, tok = real_models.loaded("gemma")
    from mlx_lm import generate

    text = generate(model, tok, "def fibonacci(n):\n", max_tokens=14)
    assert "if n" in text or "return" in text, text


def _perplexity(model, ids: list[int]) -> float:
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    nll = -mx.take_along_axis(logp, x[:, 1:, None], axis=-1).mean()
    return math.exp(nll.item())


@pytest.mark.parametrize("name,low,high", [("smollm", 8, 30), ("gemma", 8, 45)])
def test_perplexity_on_english_is_a_small_models(name, low, high):
    """A broken conversion (a permute or norm offset not undone, a wrong
    tokenizer) lands in the hundreds or thousands."""
    model, tok = real_models.loaded(name)
    ids = tok.encode(_text(8000))[:384]
    assert low < _perplexity(model, ids) < high


def test_gemma_seed_scenario_every_layer_quantized_and_windows_bounded():
    model, tok = real_models.loaded("gemma")
    kv = default_kv_config(has_bounded_layers(model))
    plan = plan_kv(model, kv)
    assert plan.to_dict()["quantized_layers"] == plan.to_dict()["kv_layers"] == 18
    cache = plan.make_cache()
    from mlx_kvq.generate import generate_step

    prompt = tok.encode(_text(3000))[:500]
    kinds = [plan.layer(i).kind for i in range(len(cache))]
    sliding, full = [], []
    for n, _ in enumerate(generate_step(mx.array(prompt), model, prompt_cache=cache)):
        if n >= 20:  # past the 512-token window
            sliding.append(
                sum(c.nbytes for c, k in zip(cache, kinds, strict=True) if k == "sliding")
            )
            full.append([c.offset for c, k in zip(cache, kinds, strict=True) if k == "full"])
        if n == 30:
            break
    assert len(set(sliding)) == 1, sliding
    assert len({*full[0]}) == len({*full[-1]}) == 1  # the three full layers alike
    assert full[0][0] > 512
    assert full[-1][0] - full[0][0] == 10  # the full layers hold every token


def test_gemma_server_ready_only_after_warmup_and_calls_a_generic_tool(tmp_path):
    gate = tmp_path / "gate"
    real_models.use_test_cache()
    real_models.converted("gemma")  # converted once; the server reuses it
    source = real_models.gemma_gguf()
    flags = ("--warmup-gate", str(gate), "--max-tokens", "16", "--tool-format", "json")
    with ServerProcess(source, *flags) as s:
        s.wait_for("/live", 200)
        r = s.health()
        assert r.status_code == 503 and r.json() == {"status": "warming_up"}
        gate.touch()
        body = s.wait_ready().json()
        assert body["plan"]["quantized_layers"] == body["plan"]["kv_layers"] == 18
        assert "converted earlier" in s.log()
        r = s.client().completions.create(
            model="default_model", prompt=_text(2500), max_tokens=8, temperature=0
        )
        assert r.usage.prompt_tokens > 512 and r.usage.completion_tokens == 8
        # Gemma 3's template renders no tools: the generic format's answer has
        # the API's shape (which call a base model makes is not the point).
        claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=600)
        m = claude.messages.create(
            model="gemma", max_tokens=40, tools=[WEATHER_TOOL], tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        )  # fmt: skip
    (call,) = m.content
    assert (call.type, call.name, m.stop_reason) == ("tool_use", "get_weather", "tool_use")
    assert set(call.input) == {"city"} and isinstance(call.input["city"], str)


def test_smollm_chat_through_openai_and_anthropic_sdks():
    real_models.converted("smollm")
    with ServerProcess(real_models.smollm_gguf()) as s:
        s.wait_ready()
        r = s.client().chat.completions.create(
            model="default_model", messages=CAPITAL, max_tokens=12, temperature=0
        )
        assert "Paris" in r.choices[0].message.content
        claude = anthropic.Anthropic(base_url=s.url, api_key="none", max_retries=0, timeout=120)
        m = claude.messages.create(
            model="default_model", max_tokens=12, messages=CAPITAL
        )  # greedy: the server's default --temp 0
        assert "Paris" in m.content[0].text


STEPS = 8


def _forced(tokens: list[int]):
    """A sampler that answers `tokens` in turn, whatever the logits say: every
    arm then decodes the same text and its distributions compare step by step."""
    it = iter(tokens)
    return lambda logprobs: mx.array([next(it, 0)], dtype=mx.uint32)


def _decode(model, caches, prompts, forced=None):
    """Each prompt's STEPS tokens (greedy, or `forced` per prompt) and their
    log-probabilities, through mlx-lm's batch loop with `caches` (None: its own)."""
    bg = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts))
    samplers = None if forced is None else [_forced(t) for t in forced]
    uids = bg.insert(prompts, max_tokens=[STEPS] * len(prompts), caches=caches, samplers=samplers)
    tokens = {u: [] for u in uids}
    logprobs = {u: [] for u in uids}
    while any(len(t) < STEPS for t in tokens.values()):
        _, responses = bg.next()
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(np.array(r.logprobs.astype(mx.float32)))
    bg.close()
    return [tokens[u] for u in uids], [np.stack(logprobs[u]) for u in uids]


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    return (np.exp(p) * (p - q)).sum(-1)


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_paged_layout_matches_padded_rows(name):
    model, tok = real_models.loaded(name)
    kv = default_kv_config(has_bounded_layers(model))
    plan = plan_kv(model, kv, batch=True)
    text = tok.encode(_text(8000), add_special_tokens=False)
    layout = choose_layout(plan, AUTO_BLOCK_SIZE)  # the engine's block size for this plan
    # the second row writes blocks in every layout (a split layout's block
    # leaves its tail `residual` tokens before the end)
    long = layout.block_size + max(p.key_spec.residual for p in plan.kv_layers) + 40
    prompts = [text[:20], text[100 : 100 + long], text[1400:1440]]
    exact = _decode(model, None, prompts)  # the text every arm then decodes
    padded = _decode(model, [plan.make_cache() for _ in prompts], prompts, exact[0])
    pages = Pages(layout.block_size)
    paged = _decode(
        model, [page_caches(plan.make_cache(), pages) for _ in prompts], prompts, exact[0]
    )
    assert set(pages.pools) == layout.paged
    assert all(p.generation for p in pages.pools.values())  # every pool took blocks
    assert paged[0] == padded[0] == exact[0]  # the forced text, in every arm
    # The layouts sum in different orders; where a difference crosses a
    # rounding boundary of the next layer's quantization it moves a value by a
    # whole step, so the layouts are held to a small part of the quantization's
    # own effect, not to float precision, and may differ on a near tie.
    top = [np.concatenate([x.argmax(-1) for x in arm[1]]) for arm in (paged, padded)]
    assert (top[0] == top[1]).mean() >= 0.9, top
    noise = np.concatenate([_kl(e, b) for b, e in zip(padded[1], exact[1], strict=True)])
    if any(is_split(p.key_spec, p.value_spec) for p in plan.kv_layers):
        # the split layout's paged groups start at position 0 and its blocks
        # keep up to a block more tokens exact: other tokens are quantized, in
        # other groups, so paged is held to padded's own distance from exact
        paged_noise = np.concatenate([_kl(e, b) for b, e in zip(paged[1], exact[1], strict=True)])
        assert paged_noise.mean() < 2 * noise.mean(), (paged_noise, noise)
        return
    between = np.concatenate([_kl(b, a) for a, b in zip(paged[1], padded[1], strict=True)])
    assert between.mean() < 0.2 * noise.mean(), (between, noise)
