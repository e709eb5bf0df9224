"""Unit tests of the engine's pure parts: prompt cache caps, stop strings, warm-up rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvq_testing.helpers import tiny_model

from mlx_kvq.config import KVConfig, UnsupportedKVConfig
from mlx_kvq.defaults import DEFAULT_FULL_KV_CONFIG
from mlx_kvq.engine.prompt_cache import PromptCache
from mlx_kvq.engine.requests import Segment
from mlx_kvq.engine.stops import StopMatcher
from mlx_kvq.engine.warmup import (
    FILLER_IDS,
    check_batch_path,
    filler_tokens,
    held_exact,
    verify_warmup,
    warmup_spec,
)
from mlx_kvq.plan import plan_kv


class FakeCache:
    """Just enough of the cache protocol for the prompt cache: bytes and trimming."""

    def __init__(self, tokens: int, bytes_per_token: int = 10, trimmable: bool = True):
        self.tokens = tokens
        self.bpt = bytes_per_token
        self.trimmable = trimmable

    @property
    def nbytes(self) -> int:
        return self.tokens * self.bpt

    @property
    def state(self) -> list:
        return []

    @state.setter
    def state(self, v) -> None:
        pass

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> int:
        n = min(n, self.tokens)
        self.tokens -= n
        return n


def entry(tokens: list[int], **kw) -> list[FakeCache]:
    return [FakeCache(len(tokens), **kw), FakeCache(len(tokens), **kw)]


# ---------------------------------------------------------------- prompt cache
def test_prefix_reuse_and_private_copies():
    pc = PromptCache(max_entries=4)
    pc.insert([1, 2, 3, 4], entry([1, 2, 3, 4]))
    cache, n = pc.fetch([1, 2, 3, 4, 5, 6])
    assert n == 4 and cache[0].tokens == 4
    cache[0].tokens = 0  # the stored entry is untouched
    again, _ = pc.fetch([1, 2, 3, 4, 9])
    assert again[0].tokens == 4


def test_exact_and_diverging_prompts_are_trimmed_and_leave_one_token():
    pc = PromptCache(max_entries=4)
    pc.insert([1, 2, 3, 4, 5], entry([1, 2, 3, 4, 5]))
    cache, n = pc.fetch([1, 2, 3, 4, 5])  # whole prompt cached: one token left to feed
    assert n == 4 and cache[0].tokens == 4
    cache, n = pc.fetch([1, 2, 7, 8])  # diverges after two tokens
    assert n == 2 and cache[0].tokens == 2


def test_untrimmable_entries_are_only_used_as_exact_prefixes():
    pc = PromptCache(max_entries=4)
    pc.insert([1, 2, 3, 4], entry([1, 2, 3, 4], trimmable=False))
    assert pc.fetch([1, 2, 9]) == (None, 0)
    cache, n = pc.fetch([1, 2, 3, 4, 9])
    assert n == 4


def test_entry_cap_is_lru():
    pc = PromptCache(max_entries=2)
    pc.insert([1], entry([1], trimmable=False))
    pc.insert([2], entry([2], trimmable=False))
    pc.fetch([1, 5])  # touch [1]
    pc.insert([3], entry([3], trimmable=False))
    assert len(pc) == 2
    assert pc.fetch([2, 5]) == (None, 0)
    assert pc.fetch([1, 5])[1] == 1


def test_byte_cap_counts_real_bytes_and_refuses_oversized_entries():
    pc = PromptCache(max_entries=100, max_bytes=500)
    assert pc.insert(list(range(10)), entry(list(range(10))))  # 200 bytes
    assert pc.nbytes == 200
    assert not pc.insert(list(range(100, 130)), entry(list(range(30))))  # 600 > cap
    assert pc.nbytes == 200 and pc.stats().rejected == 1
    pc.insert(list(range(200, 210)), entry(list(range(10))))
    pc.insert(list(range(300, 310)), entry(list(range(10))))  # 600 > 500: evict oldest
    assert pc.nbytes == 400 and len(pc) == 2


def test_budget_from_live_sequences_lowers_the_cap():
    pc = PromptCache(max_entries=100, max_bytes=1000)
    for i in range(4):
        pc.insert([i] * 10, entry([i] * 10, trimmable=False))
    assert pc.nbytes == 800
    pc.trim_to(300)
    assert pc.nbytes <= 300


def test_trimmable_longer_entry_replaces_its_prefixes():
    pc = PromptCache(max_entries=10)
    pc.insert([1, 2], entry([1, 2]))
    pc.insert([1, 2, 3, 4], entry([1, 2, 3, 4]))
    assert len(pc) == 1 and pc.nbytes == 80


def test_disabled_cache_stores_nothing():
    pc = PromptCache(max_entries=0)
    assert not pc.insert([1, 2], entry([1, 2]))
    assert len(pc) == 0


def test_an_entry_is_kept_until_the_request_counting_on_it_copied_it():
    """An admitted request's entry outlives every trim until it has
    its copy, and what it holds is counted as kept meanwhile."""
    pc = PromptCache(max_entries=4)
    pc.insert([1, 2, 3], entry([1, 2, 3], trimmable=False), segment=Segment.CONTEXT)
    pc.pin((1, 2, 3), 7)
    pc.trim_to(0)
    assert len(pc) == 1 and pc.kept_nbytes() == pc.nbytes == 60
    assert not pc.insert([5], entry([5], trimmable=False), budget=70)  # no room beside it
    pc.copied(7, mapped=3)  # not a system prompt: nothing keeps it any more
    assert pc.kept_nbytes() == 0
    pc.trim_to(0)
    assert len(pc) == 0


def test_a_system_prompt_is_kept_while_two_sequences_that_mapped_it_run():
    """The prefix live sessions share stays for a preempted one to resume
    from, while at least two of them run."""
    pc = PromptCache(max_entries=4)
    system = [1, 2, 3]
    pc.insert(system, entry(system, trimmable=False), segment=Segment.SYSTEM)
    for owner in (1, 2):
        pc.pin(tuple(system), owner)
        pc.copied(owner, mapped=len(system))
    pc.trim_to(0)
    assert len(pc) == 1 and pc.kept_nbytes() == 60
    pc.unpin(1)  # one of them ended
    pc.trim_to(0)
    assert len(pc) == 0


def test_an_insertion_is_refused_rather_than_evict_what_the_order_keeps_longer():
    """mlx-lm's order applies to the entry being inserted too: a request's
    prompt copy does not evict the only system prompt for room."""
    pc = PromptCache(max_entries=4, max_bytes=150)
    pc.insert([1, 2, 3, 4, 5], entry([1, 2, 3, 4, 5], trimmable=False), segment=Segment.SYSTEM)
    prompt = [1, 2, 3, 4, 5, 6]
    assert not pc.insert(prompt, entry(prompt, trimmable=False), segment=Segment.CONTEXT)
    assert pc.fetch([1, 2, 3, 4, 5, 9])[1] == 5 and pc.stats().rejected == 1


@settings(max_examples=200, deadline=None)
@given(
    cap=st.integers(0, 2000),
    max_entries=st.integers(0, 6),
    ops=st.lists(
        st.tuples(
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
            st.booleans(),
            st.one_of(st.none(), st.integers(-100, 2000)),
        ),
        max_size=30,
    ),
)
def test_caps_hold_after_every_operation(cap, max_entries, ops):
    pc = PromptCache(max_entries=max_entries, max_bytes=cap)
    for tokens, trimmable, budget in ops:
        if budget is not None and budget % 3 == 0:
            pc.fetch(tokens)
        pc.insert(tokens, entry(tokens, trimmable=trimmable), budget)
        held = sum(c.nbytes for e in pc._entries.values() for c in e.cache)
        assert pc.nbytes == held
        assert held <= cap
        if budget is not None:
            assert held <= max(0, budget)
        assert len(pc) <= max_entries


# ---------------------------------------------------------------- stop strings
def test_stop_string_cuts_and_holds_back_partial_matches():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.feed("Dx") == ("", True)
    m = StopMatcher(["END"])
    assert m.feed("hello EN") == ("hello ", False)
    assert m.feed("!", final=True) == ("EN!", False)
    # The stop that completes first wins, even if a longer one started earlier.
    assert StopMatcher(["c", "XcX"]).feed("XXcX") == ("XX", True)
    assert StopMatcher(["Xc", "c"]).feed("aXc") == ("a", True)


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcXY", max_size=40),
    stops=st.lists(st.text(alphabet="abcXY", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_streamed_stop_matching_equals_whole_text_matching(text, stops, cuts):
    bounds = sorted({0, len(text), *[c for c in cuts if c <= len(text)]})
    m = StopMatcher(stops)
    out, hit = "", False
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        piece, hit = m.feed(text[a:b], final=i == len(bounds) - 2)
        out += piece
        if hit:
            break
    if len(bounds) == 1:
        out, hit = m.feed("", final=True)
    # Whole-text oracle: scan end positions; the first stop to complete wins.
    expected, stopped = text, False
    for end in range(1, len(text) + 1):
        done = [end - len(s) for s in stops if text[:end].endswith(s)]
        if done:
            expected, stopped = text[: min(done)], True
            break
    assert out == expected and hit == stopped


# ---------------------------------------------------------------- warm-up rules
def test_warmup_goes_past_window_and_quantized_start():
    spec = warmup_spec(16, KVConfig(bits=4, quantized_start=40), None)
    assert spec.must_exceed == 40 and spec.long > 40
    assert spec.batch_size >= 3 and len(set(spec.joining)) == len(spec.joining)
    with pytest.raises(UnsupportedKVConfig, match="quantized-kv-start"):
        warmup_spec(16, KVConfig(bits=4, quantized_start=1000), 512)


def test_warmup_goes_past_what_a_split_layer_keeps_exact():
    """A split layer quantizes its first tokens only once its sinks, residual
    and a whole flush unit (a key group, or a block in the paged form) are
    held: a shorter warm-up would prove only its exact path."""
    kv = DEFAULT_FULL_KV_CONFIG
    plan = plan_kv(tiny_model("llama"), kv, batch=True)
    k = kv.key_spec
    assert held_exact(plan, None) == k.sinks + k.residual + k.group_size - 1
    assert held_exact(plan, 256) == k.sinks + k.residual + 256 - 1
    assert held_exact(plan_kv(tiny_model("llama"), KVConfig(bits=4), batch=True), 256) == 0
    spec = warmup_spec(None, kv.with_(quantized_start=10), None, held_exact(plan, None))
    assert spec.must_exceed == 10 + held_exact(plan, None) and spec.long > spec.must_exceed
    with pytest.raises(UnsupportedKVConfig, match="kept exact"):
        warmup_spec(None, kv, 200, held_exact(plan, None))


@pytest.mark.parametrize("vocab", [5, 300, 70000])
def test_warmup_prompts_are_ids_every_embedding_table_holds(vocab):
    """The warm-up runs before the tokenizer is loaded: its prompts are ids
    below the smallest embedding table (and `FILLER_IDS`), padding's 0 left out,
    varied enough that no two neighbours repeat."""
    ids = filler_tokens(tiny_model("llama", vocab_size=vocab))
    top = min(vocab, FILLER_IDS)
    assert ids and all(1 <= t < top for t in ids)
    assert len(set(ids)) == top - 1
    assert all(a != b for a, b in zip(ids, ids[1:], strict=False))


def _slot(kind, quantized=True, tokens=20):
    return {"kind": kind, "quantized": quantized, "nbytes": 100, "tokens": tokens}


def test_verify_warmup_requires_every_kv_kind_quantized():
    kv = KVConfig(bits=4)
    spec = warmup_spec(8, kv, None)
    ok = [_slot("sliding", tokens=8), _slot("full")]
    report = verify_warmup(kv, 2, ok, ok, 20, spec)
    assert report["batch"]["sliding"]["quantized"] == 1
    with pytest.raises(Exception, match="sliding caches were not quantized"):
        verify_warmup(kv, 2, [_slot("sliding", False), _slot("full")], ok, 20, spec)
    with pytest.raises(Exception, match="the batch held 1 KV caches, the plan has 2"):
        verify_warmup(kv, 2, [_slot("full")], ok, 20, spec)
    with pytest.raises(Exception, match="needs >"):
        verify_warmup(kv, 2, ok, ok, 5, spec)
    unquantized = [_slot("sliding", False), _slot("full", False)]
    verify_warmup(KVConfig(), 2, unquantized, unquantized, 20, spec)  # --kv-bits 0


class _NoStartBatch:
    def __init__(self):
        self.start = None


class _NoStartCache:
    """A cache whose batch form ignores quantized_kv_start."""

    @classmethod
    def merge(cls, caches):
        return _NoStartBatch()


class _NoMergeCache:
    pass


def test_batch_path_refuses_settings_it_would_ignore():
    def report(caches):
        return [_slot("full") for _ in caches]

    kv = KVConfig(bits=4, quantized_start=64)
    with pytest.raises(UnsupportedKVConfig, match="--quantized-kv-start 64 cannot be honoured"):
        check_batch_path(lambda: [_NoStartCache()], kv, report)
    check_batch_path(lambda: [_NoStartCache()], KVConfig(bits=4), report)  # start 0: fine
    with pytest.raises(UnsupportedKVConfig, match="no batch form"):
        check_batch_path(lambda: [_NoMergeCache()], KVConfig(bits=4), report)
