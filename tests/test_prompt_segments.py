"""Multi-turn prompt reuse on a hybrid model whose windows wrap.

The engine runs in-process on a scripted gemma3_text model (sliding windows
of 16 tokens, quantized): every turn is longer than the windows, so no
cache can be trimmed back and only exact prefixes are reusable. Checked:
with a template that keeps history verbatim, from turn 2 on only the new
turn is prefilled; with one that drops earlier reasoning, everything up to
the previous generation prompt is reused; with one that opens the
reasoning block in the generation prompt, the prompt before that block is
reused (mlx-lm's think-tail segment); a new conversation reuses the system
prompt; eviction follows mlx-lm's server order; every cap still holds.
"""

from __future__ import annotations

import pytest
from kvq_testing.events import WAIT_S, Collector
from kvq_testing.scripted import save_scripted_model
from mlx_lm import load
from test_engine_units import entry

from mlx_kvq.config import KVConfig
from mlx_kvq.engine import (
    Checkpoint,
    Engine,
    EngineOptions,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    Segment,
)
from mlx_kvq.engine.prompt_cache import PromptCache, common_prefix
from mlx_kvq.engine.prompts import chat_tokens
from mlx_kvq.engine.segments import PARTING_MIN, chat_checkpoints, parting_points, split_prompt
from mlx_kvq.plan import plan_kv

SYSTEM = "You answer questions about the shelves of a small library, briefly. " * 2
TURNS = 3
SCRIPT = {
    f"QQ{k}": ["<think>", f"\nLook up {k}.\n", "</think>", f"\n\nShelf {k}."]
    for k in range(1, TURNS + 1)
}


def user_text(k: int, variant: int = 0) -> str:
    words = "river mountain bridge window garden harbor lantern meadow orchard pebble".split()
    return f"Question QQ{k}: " + " ".join(words[(k + variant + i) % 10] for i in range(24))


# ------------------------------------------------------------------ pure parts
def test_split_prompt_cuts_at_checkpoints_past_the_cached_part():
    prompt = list(range(20))
    cps = (Checkpoint(5, Segment.SYSTEM), Checkpoint(15, Segment.CONTEXT))
    pieces, cuts = split_prompt(prompt, 0, cps)
    assert pieces == [prompt[:5], prompt[5:15], prompt[15:]]
    assert cuts == [Segment.SYSTEM, Segment.CONTEXT, Segment.CONTEXT]
    pieces, cuts = split_prompt(prompt, 7, cps)  # the system prompt is cached already
    assert pieces == [prompt[7:15], prompt[15:]] and cuts == [Segment.CONTEXT, Segment.CONTEXT]
    # a checkpoint at the last token's place is BatchGenerator's own cut
    pieces, cuts = split_prompt(prompt, 0, (Checkpoint(19, Segment.CONTEXT),))
    assert pieces == [prompt] and cuts == [Segment.CONTEXT]


def test_parting_points_are_the_longest_shared_prefixes_that_add_enough():
    prompt = list(range(1000))
    beside = [list(range(300)) + [-1] * 50, list(range(200)) + [-2]]
    held = [tuple(range(600)) + (-3,), tuple(range(700))]  # the second covers 700: no parting
    cuts = parting_points(prompt, 0, beside, held[:1])
    assert [(c.length, c.segment) for c in cuts] == [(300, Segment.SYSTEM), (600, Segment.CONTEXT)]
    # what the prompt starts from already covers it, or it adds too little
    assert parting_points(prompt, 300 - PARTING_MIN + 1, beside) == ()
    assert parting_points(prompt, 0, [prompt]) == ()  # never the last token
    # a parting point and a checkpoint at one length: the checkpoint names the segment
    parting = parting_points(prompt, 0, held=[tuple(range(300)) + (-4,)])
    pieces, cuts = split_prompt(prompt, 0, (Checkpoint(300, Segment.SYSTEM), *parting))
    assert [len(p) for p in pieces] == [300, 700] and cuts == [Segment.SYSTEM, Segment.CONTEXT]


def test_eviction_follows_mlx_lm_server_order():
    pc = PromptCache(max_entries=3)
    pc.insert([1], entry([1], trimmable=False), segment=Segment.SYSTEM)
    pc.insert([1, 2], entry([1, 2], trimmable=False), segment=Segment.CONTEXT)
    pc.insert([1, 2, 3], entry([1, 2, 3], trimmable=False), segment=Segment.ANSWER)
    pc.insert([1, 2, 3, 4], entry([1, 2, 3, 4], trimmable=False), segment=Segment.ANSWER)
    # the older answer goes first, the system prompt stays
    keys = {n for n in (1, 2, 3, 4) if pc.fetch(list(range(1, n + 1)) + [99])[1] == n}
    assert keys == {1, 2, 4}
    stats = {s: (n, b) for s, n, b in pc.stats().by_segment}
    assert stats == {"system": (1, 20), "user": (1, 40), "assistant": (1, 80)}
    pc.insert([5], entry([5], trimmable=False), segment=Segment.CONTEXT)
    # answers (1) are fewer than prefixes (2): a prefix goes, the oldest one
    assert pc.fetch([1, 2, 99])[1] == 1 and pc.fetch([5, 99])[1] == 1
    assert len(pc) == 3 and pc.stats().evictions == 2


def test_byte_cap_holds_with_segments():
    pc = PromptCache(max_entries=100, max_bytes=250)
    for n, seg in ((3, Segment.SYSTEM), (5, Segment.CONTEXT), (6, Segment.ANSWER)):
        pc.insert(list(range(n)), entry(list(range(n)), trimmable=False), segment=seg)
        assert pc.nbytes <= 250
    assert sum(b for _, _, b in pc.stats().by_segment) == pc.nbytes


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("segments")
    out = {}
    for template in ("qwen3", "qwen3_keep_reasoning", "qwen3_open_think"):
        reply = SCRIPT
        if template == "qwen3_open_think":  # the generation prompt opened <think> already
            reply = {t: pieces[1:] for t, pieces in SCRIPT.items()}
        path = save_scripted_model(root / template, reply, template=template, arch="hybrid")
        model, tokenizer = load(str(path))
        kv = KVConfig(bits=4, group_size=64)
        plan = plan_kv(model, kv, batch=True)
        assert plan.max_window == 16
        out[template] = (model, tokenizer, plan, kv)
    return out


def run_engine(loaded):
    model, tokenizer, plan, kv = loaded
    engine = Engine(
        model,
        tokenizer,
        plan,
        kv,
        EngineOptions(prompt_cache_size=10, max_context=plan.max_context),
    )
    engine.start()
    assert engine.readiness.ready_event.wait(WAIT_S) and engine.readiness.ready
    return engine


def ask(engine, tokenizer, messages):
    prompt = chat_tokens(tokenizer, messages)
    checkpoints = chat_checkpoints(tokenizer, messages, prompt)
    c = Collector()
    engine.submit(
        GenerationRequest(prompt, SamplingParams(max_tokens=16), checkpoints=checkpoints), c
    )
    c.wait()
    assert isinstance(c.end, FinishEvent), c.end
    return prompt, checkpoints, c


@pytest.mark.parametrize("template", ["qwen3_keep_reasoning", "qwen3", "qwen3_open_think"])
def test_turn_k_reuses_the_earlier_turns(models, template):
    model, tokenizer, plan, kv = models[template]
    engine = run_engine(models[template])
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        previous = None  # (prompt, generated token ids) of the turn before
        for k in range(1, TURNS + 1):
            messages.append({"role": "user", "content": user_text(k)})
            prompt, checkpoints, c = ask(engine, tokenizer, messages)
            usage = c.end.usage
            assert usage.prompt_tokens == len(prompt) > 100  # every turn wraps the windows
            if previous is None:
                assert usage.cached_tokens == 0
                system_end = checkpoints[0].length
                assert checkpoints[0].segment is Segment.SYSTEM
                assert tokenizer.decode(prompt[:system_end]).startswith("<|im_start|>system")
            elif template == "qwen3_keep_reasoning":
                # the previous prompt and its answer (EOS included) are a prefix: only
                # the new turn is prefilled
                before, generated = previous
                assert prompt[: len(before) + len(generated)] == before + generated
                assert usage.cached_tokens == len(before) + len(generated)
            elif template == "qwen3":
                # the earlier answer is re-rendered without its reasoning: the previous
                # prompt is reused up to its last token (all but the last are cached),
                # or further where the answer's windows still hold the tokens to cut back
                before, generated = previous
                shared = common_prefix(prompt, before + generated)
                assert len(before) - 1 <= usage.cached_tokens <= shared
            else:
                # the previous generation prompt opened <think>, which history drops:
                # the prompt before its think tail is reused
                before = previous[0]
                tail = tokenizer.rfind_think_start(before)
                assert tail == len(before) - 2 and prompt[:tail] == before[:tail]
                assert usage.cached_tokens == tail
            assert c.text.endswith(f"Shelf {k}.")
            previous = (prompt, c.tokens)
            messages.append({"role": "assistant", "content": c.text})

        # a new conversation with the same system prompt starts from its segment
        fresh = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": user_text(1, variant=3)},
        ]
        prompt, _, c = ask(engine, tokenizer, fresh)
        assert c.end.usage.cached_tokens == system_end
        stats = engine.prompt_cache.stats()
        kinds = {s: n for s, n, _ in stats.by_segment}
        assert kinds["system"] == 1 and stats.entries <= 10
    finally:
        engine.stop()


def raw(tokenizer, words: int, tail: int) -> list[int]:
    """A plain-text prompt: a shared document of `words` words, then a tail of
    its own (`tail` picks the words)."""
    body = " ".join(f"w{i % 37}" for i in range(words))
    own = " ".join(f"t{(tail * 7 + i) % 31}" for i in range(40))
    return tokenizer.encode(f"{body}\n\nQuestion: {own}")


def send(engine, prompt: list[int]) -> Collector:
    c = Collector()
    engine.submit(GenerationRequest(prompt, SamplingParams(max_tokens=4)), c)
    return c


def test_raw_prompts_part_where_they_differ_and_later_ones_start_there(models):
    """Plain prompts carry no checkpoints: they are cut where they part from the
    prompts beside them and from the prompt cache's entries, wrapped windows
    and all, so the next prompt to share that prefix starts from it."""
    model, tokenizer, plan, kv = models["qwen3"]
    engine = run_engine(models["qwen3"])
    try:
        first = raw(tokenizer, 300, 1)
        shared = common_prefix(first, raw(tokenizer, 300, 2))
        assert shared > PARTING_MIN + 100
        # alone: nothing to part from, nothing cached
        c = send(engine, first)
        c.wait()
        assert c.end.usage.cached_tokens == 0
        # it parts from the first's entries (wrapped windows: none serves it)
        c = send(engine, raw(tokenizer, 300, 2))
        c.wait()
        assert c.end.usage.cached_tokens == 0
        # the third starts where the second parted from the first
        c = send(engine, raw(tokenizer, 300, 3))
        c.wait()
        assert c.end.usage.cached_tokens == shared

        # sent together: the later ones wait for the copy where they part from the first
        longer = [raw(tokenizer, 450, t) for t in range(4, 8)]
        together = common_prefix(longer[0], longer[1])
        assert together > shared + PARTING_MIN
        cs = [send(engine, p) for p in longer]
        for c in cs:
            c.wait()
            assert isinstance(c.end, FinishEvent), c.end
        cached = sorted(c.end.usage.cached_tokens for c in cs)
        assert cached[0] <= shared and cached[1:] == [together] * 3
    finally:
        engine.stop()


class _FailsOnEmptyTurn:
    """A chat template that refuses an empty user message (as some do)."""

    chat_template = "a template"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        if any(m["role"] == "user" and not m["content"] for m in messages):
            raise ValueError("user messages must not be empty")
        return [len(m["content"]) + 3 for m in messages] + [1] * add_generation_prompt


def test_a_template_that_cannot_render_the_system_part_says_so_once(caplog):
    """No system-prompt checkpoint then, and a warning with the template's
    reason, logged once however many requests meet it."""
    from mlx_kvq.engine import segments

    tokenizer = _FailsOnEmptyTurn()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    prompt = chat_tokens(tokenizer, [dict(m) for m in messages])
    segments._reported.clear()
    with caplog.at_level("WARNING", logger="mlx_kvq.engine.segments"):
        for _ in range(3):
            assert chat_checkpoints(tokenizer, [dict(m) for m in messages], prompt) == ()
    said = [r.getMessage() for r in caplog.records if r.name == "mlx_kvq.engine.segments"]
    assert len(said) == 1, said
    assert "ValueError: user messages must not be empty" in said[0]
    assert "system prompts are not cached" in said[0]
