"""The paged form of the split layout: whole quantized blocks shared by
prefix, each row's exact tail and sinks beside them (caches/paged/split.py)."""

from __future__ import annotations

import inspect

import mlx.core as mx
import numpy as np
import pytest
from kvq_testing.events import WAIT_S, Collector
from kvq_testing.helpers import started
from kvq_testing.tiny import save_tiny_model
from mlx_lm import load
from mlx_lm.models import llama

import mlx_kvq
from mlx_kvq import attention
from mlx_kvq import evaluate as ev
from mlx_kvq.attention import count_attention
from mlx_kvq.caches import (
    KVQPagedSplitCache,
    KVQPagedSplitSequence,
    KVQSplitCache,
    KVQSplitWindowCache,
    Pages,
    keep_in_prompt_cache,
    page_caches,
    unpage_caches,
)
from mlx_kvq.caches.paged import (
    BlockPool,
    SplitBlockStorage,
    exact_tokens_held,
    tail_slots,
)
from mlx_kvq.commands import build_parser, main
from mlx_kvq.commands.serve import engine_options
from mlx_kvq.config import AUTO_BLOCK_SIZE, KVConfig, QuantSpec, UnsupportedKVConfig
from mlx_kvq.defaults import DEFAULT_FULL_KV_CONFIG
from mlx_kvq.engine import Engine, EngineOptions, GenerationRequest, SamplingParams
from mlx_kvq.engine.runner import choose_layout
from mlx_kvq.generate import KV_KEYS, get_plan
from mlx_kvq.plan import plan_kv
from mlx_kvq.quant import PagedSplitKV


def _tiny():
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128,
        rms_norm_eps=1e-5,
    )  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def _cfg(sinks: int, residual: int = 8) -> KVConfig:
    return KVConfig(
        bits=4, group_size=32, key_scales="channel", key_group_size=32,
        residual=residual, sinks=sinks,
    )  # fmt: skip


def _paged(plan, pages: Pages) -> list:
    return [type(c).merge([c]) for c in page_caches(plan.make_cache(), pages)]


TOKENS = mx.random.randint(0, 128, (1, 150), key=mx.random.key(4))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("sinks", [0, 4])
def test_paged_rows_compute_what_the_padded_split_cache_computes(sinks, native, monkeypatch):
    """Chunked prefill then decode. Without sinks the body's groups are the
    padded cache's, so the logits are equal (to float rounding where the
    native kernel reads the blocks in place: another order of sums); with
    sinks the paged groups start at position 0 (the padded ones after the
    sinks): close, same top token."""
    if native and not attention._native():
        pytest.skip("native kernels not built")
    monkeypatch.setattr(attention, "_native", lambda n=attention._native() and native: n)
    model = _tiny()
    plan = get_plan(model, _cfg(sinks))
    padded = plan.make_cache()
    assert {type(c) for c in padded} == {KVQSplitCache}
    paged = _paged(plan, Pages(32))
    assert {type(c) for c in paged} == {KVQPagedSplitCache}
    steps = [TOKENS[:, s : s + 16] for s in range(0, 150, 16)]
    steps += [mx.array([[i]]) for i in range(20)]
    for x in steps:
        with count_attention() as calls:
            b = model(x, cache=paged)[:, -1]
        assert calls["quantized"] == 2 and calls["full_precision"] == 0
        a = model(x, cache=padded)[:, -1]
        if sinks:
            assert mx.abs(a - b).max().item() < 0.1
        elif native:
            assert mx.abs(a - b).max().item() < 1e-5
        else:
            assert mx.array_equal(a, b).item()
        assert a.argmax().item() == b.argmax().item()
    # blocks end `residual` (8) or more before the end; without sinks the
    # same tokens are exact as in the padded cache
    for p, q in zip(padded, paged, strict=True):
        n = q.tables[0].length
        assert n == 160 and q.offset.item() == p.offset == 170
        assert 8 <= p.store.tail_len < 8 + 32
        assert (p.store.tail_len == 10) == (not sinks)
        if sinks:
            assert p.store.head_len == sinks
            assert q.pool.storage.sinks[q.tables[0].ids[0]][0].shape[2] == sinks


def test_bytes_are_counted_from_what_is_held():
    model = _tiny()
    plan = get_plan(model, _cfg(4))
    pages = Pages(32)
    paged = _paged(plan, pages)
    model(TOKENS[:, :100], cache=paged)
    c = paged[0]
    st = c.pool.storage
    blocks = len(c.tables[0].ids)
    assert blocks == 2  # 100 tokens, the last 8 exact: whole blocks up to 64
    tail = c.tails[0]
    assert tail[0].shape[2] == 36 and tail[0].dtype == mx.float16
    # the batch's tail buffer: whole steps of slots, never past what a row
    # may hold exact (residual + block size), which the budget prices
    buffer = c.buffer[0]
    assert buffer.shape[2] == min(8 + 32, 64) and buffer.dtype == mx.float16
    assert buffer.shape[2] + st.sink_count <= exact_tokens_held(32, st.key_spec, st.value_spec)
    sink = st.sinks[c.tables[0].ids[0]]
    want = blocks * st.block_bytes + sum(a.nbytes for a in (*c.buffer, *sink))
    assert c.nbytes == want
    # a 32-token block of 2 heads x 32 channels: 4-bit keys per channel (one
    # group of 32 tokens: a scale and a bias per channel), 4-bit values per
    # token in groups of 32 channels, 16-bit scales and biases
    per_part = 2 * 32 * 32 // 2 + 2 * 32 * 2 * 2
    assert st.block_bytes == 2 * per_part
    assert c.own_nbytes == c.nbytes - blocks * st.block_bytes
    assert pages.nbytes == sum(p.nbytes for p in pages.pools.values())
    assert st.nbytes == st.blocks * st.block_bytes + sum(
        k.nbytes + v.nbytes for k, v in st.sinks.values()
    )


def test_a_shared_prefix_is_shared_by_reference_and_continues_alike():
    """Two sequences from one prefix (as the prompt cache hands it out): the
    prefix's full blocks are held once, each goes on as a sequence that
    computed the prefix itself would."""
    model = _tiny()
    plan = get_plan(model, _cfg(4))
    pages = Pages(32)
    first = page_caches(plan.make_cache(), pages)
    prefix = TOKENS[:, :90]
    batch = [type(c).merge([c]) for c in first]
    model(prefix, cache=batch)
    kept = [c.extract(0) for c in batch]
    assert {type(c) for c in kept} == {KVQPagedSplitSequence}
    keep_in_prompt_cache(kept, prefix[0].tolist())
    for c in batch:
        c.filter([])
    import copy

    a, b = copy.deepcopy(kept), copy.deepcopy(kept)
    pool = kept[0].pool
    ids = kept[0].table.ids
    assert len(ids) == 2 and all(pool.refs[i] == 3 for i in ids)
    # the prefix's blocks are found by the tokens they hold
    assert pages.match(prefix[0].tolist() + [1])[(0, None)] == ids
    rows = [type(x).merge([x, y]) for x, y in zip(a, b, strict=True)]
    alone = page_caches(plan.make_cache(), Pages(32))
    alone = [type(c).merge([c]) for c in alone]
    model(prefix, cache=alone)
    nxt = mx.array([[3], [9]])
    got = model(nxt, cache=rows)[:, -1]
    want = model(nxt[1:], cache=alone)[:, -1]
    assert mx.allclose(got[1], want[0], atol=1e-5).item()
    for _ in range(40):  # both rows past the shared blocks: their new blocks are their own
        model(nxt, cache=rows)
    r = rows[0]
    assert r.tables[0].ids[:2] == r.tables[1].ids[:2] == ids
    assert not set(r.tables[0].ids[2:]) & set(r.tables[1].ids[2:])


def test_trim_right_padding_and_other_layouts():
    model = _tiny()
    plan = get_plan(model, _cfg(4))
    pages = Pages(32)
    x, y = page_caches(plan.make_cache(), pages), page_caches(plan.make_cache(), pages)
    rows = [type(c).merge([c, d]) for c, d in zip(x, y, strict=True)]
    model(mx.concatenate([TOKENS[:, :70], TOKENS[:, 10:80]]), cache=rows)
    # a right-padded chunk: the second row's padding is never quantized
    for c in rows:
        c.prepare(lengths=[40, 2], right_padding=[0, 38])
    model(mx.concatenate([TOKENS[:, 70:110], TOKENS[:, 80:120]]), cache=rows)
    for c in rows:
        c.finalize()
    r = rows[0]
    assert r.offset.tolist() == [110, 72] and [t.length for t in r.tables] == [96, 64]
    # the padded twin of the second row
    ref = plan.make_cache()
    model(TOKENS[:, 10:80], cache=ref)
    model(TOKENS[:, 80:82], cache=ref)
    step = mx.array([[5], [5]])
    assert mx.allclose(
        model(step, cache=rows)[1, -1], model(step[1:], cache=ref)[0, -1], atol=0.1
    ).item()
    # trim back into a block: its tokens come back to the tail dequantized
    one = rows[0].extract(0)
    assert one.offset == 111
    assert one.trim(30) == 30 and one.offset == 81 and one.table.length == 64
    back = unpage_caches([one])[0]
    assert type(back) is KVQSplitCache and back.offset == 81


def test_the_layout_pages_split_full_layers_and_says_why_the_others_not(tmp_path):
    path = save_tiny_model(tmp_path / "m", "llama:sliding")
    model, _ = load(str(path))
    plan = plan_kv(model, _cfg(4), batch=True)
    kinds = {type(c) for c in plan.make_cache()}
    assert kinds == {KVQSplitCache, KVQSplitWindowCache}
    layout = choose_layout(plan, 32)
    windows = [p.slot for p in plan.kv_layers if p.window is not None]
    assert len(layout.paged) == len(plan.kv_layers) - len(windows)
    assert "(in the split layout, layer" in layout.description
    assert ": sliding attention has no paged form)" in layout.description
    layout = choose_layout(plan, 16)
    assert not layout.paged
    assert "--kv-block-size 16 is not a multiple of --kv-key-group-size 32: " in layout.description


def test_with_the_disk_tier_split_layers_keep_padded_rows(tmp_path, capsys):
    """The disk tier keeps no split-layout layer in blocks: with
    `--prompt-cache-dir` the plan's own block size becomes padded rows (and
    says why), an explicit block size that would page one is refused at
    startup, and settings without split layers page as before."""
    path = save_tiny_model(tmp_path / "m", "llama")
    model, _ = load(str(path))
    split = plan_kv(model, DEFAULT_FULL_KV_CONFIG, batch=True)
    assert choose_layout(split, AUTO_BLOCK_SIZE).paged
    layout = choose_layout(split, AUTO_BLOCK_SIZE, on_disk=True)
    assert layout.block_size is None and not layout.paged
    assert "the disk tier (--prompt-cache-dir)" in layout.description
    with pytest.raises(UnsupportedKVConfig, match="--kv-block-size 128 pages the split layers"):
        choose_layout(split, 128, on_disk=True)
    per_token = plan_kv(model, KVConfig(bits=4), batch=True)
    assert choose_layout(per_token, AUTO_BLOCK_SIZE, on_disk=True).paged
    rc = main(["serve", "--model", str(path), "--prompt-cache-dir", str(tmp_path / "d"),
               "--kv-block-size", "128"])  # fmt: skip
    assert rc == 2 and "keeps no layer in the paged split layout" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("cfg", "block"),
    [
        (KVConfig(bits=4, key_scales="channel", key_group_size=128, sinks=4, residual=16), 128),
        (KVConfig(bits=4, key_scales="channel", key_group_size=64), 64),
        (_cfg(4), 32),  # key groups of 32: the plain block size is whole groups
        (KVConfig(bits=4, sinks=4, residual=16), 32),  # per-token keys: no groups to fit
        (KVConfig(bits=4), 32),
    ],
)
def test_the_default_block_size_is_whole_key_groups(tmp_path, cfg, block):
    """Without `--kv-block-size` the blocks are PAGED_BLOCK_SIZE tokens, or
    the least multiple of it that is whole key groups, so the split layout's
    full-attention layers page instead of keeping padded rows."""
    path = save_tiny_model(tmp_path / "m", "llama:sliding")
    model, _ = load(str(path))
    plan = plan_kv(model, cfg, batch=True)
    layout = choose_layout(plan, AUTO_BLOCK_SIZE)
    assert layout.block_size == block
    full = [p for p in plan.kv_layers if p.window is None]
    assert full and {(p.slot, p.member) for p in full} <= layout.paged
    assert f"in blocks of {block} tokens" in layout.description


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("ps") / "m", "llama")
    return load(str(path))


def _engine(loaded, kv, block_size):
    model, tokenizer = loaded
    plan = plan_kv(model, kv, batch=True)
    eng = Engine(
        model, tokenizer, plan, kv,
        EngineOptions(block_size=block_size, max_context=plan.max_context, prompt_cache_size=8,
                      kv_cache_memory=64 << 20),
    )  # fmt: skip
    return started(eng, WAIT_S)


def _run(eng, prompts, max_tokens=24):
    collectors = []
    for p in prompts:
        c = Collector()
        eng.submit(GenerationRequest(list(p), SamplingParams(max_tokens=max_tokens)), c)
        collectors.append(c)
    return [c.wait().tokens for c in collectors]


PREFIX = [(7 * i) % 200 + 3 for i in range(70)]
PROMPTS = [[5, 9, 11], PREFIX + [17, 18], [(3 * i) % 190 + 2 for i in range(45)], PREFIX + [21]]


def test_the_engine_serves_the_split_layout_in_blocks(engine_model):
    """Greedy text through the engine equals the padded split layout's (no
    sinks: the same groups), and the prefix's blocks are shared."""
    kv = _cfg(0)
    padded = _engine(engine_model, kv, None)
    try:
        want = _run(padded, PROMPTS)
    finally:
        padded.stop()
    paged = _engine(engine_model, kv, 32)
    try:
        with count_attention() as calls:
            got = _run(paged, PROMPTS)
        assert calls["quantized"] > 0 and calls["full_precision"] == 0
        pools = paged.runner.pages.pools.values()
        assert pools and all(isinstance(p.storage, SplitBlockStorage) for p in pools)
        again = _run(paged, [PREFIX + [17, 18]])
        assert paged.metrics.snapshot().prefix_blocks_reused > 0
        # what rows hold beside the pool is within what the budget promised them
        assert paged.budget.bound_misses == 0 and paged.budget.overruns == 0
    finally:
        paged.stop()
    assert got == want and again[0] == want[1]


def test_eval_scores_the_paged_form():
    """`eval --kv-block-size`: the layers that page are scored in blocks, and
    without sinks they score what the padded split cache scores (to float
    rounding: the decode steps' native kernel sums in another order)."""
    model = _tiny()
    tokens = TOKENS[0].tolist() * 2
    cfg = _cfg(0)
    kw = dict(context=120, chunk=16, windows=2, progress=False, decode=8, held_context=None)
    padded, paged = (
        ev.evaluate_many(model, tokens, [cfg], block_size=b, **kw)[0] for b in (None, 32)
    )
    assert padded["paged_layers"] == 0 and paged["paged_layers"] == 2
    assert paged["kl_mean"] == pytest.approx(padded["kl_mean"], rel=1e-3)
    assert paged["top1"] == padded["top1"]


SPLIT_CASES = [
    # keys per channel with rotation, 4 sinks, values rotated: the shipped shape
    (QuantSpec(4, 32, "hadamard", True, 4, 16), QuantSpec(3, 32, "hadamard", False, 4, 16)),
    # keys per channel without rotation, no sinks, no exact tail
    (QuantSpec(5, 32, per_channel=True), QuantSpec(6, 32, residual=0)),
    # per-token keys with sinks and an exact tail
    (QuantSpec(8, 32, sinks=2, residual=8), QuantSpec(4, 32, sinks=2, residual=8)),
]


@pytest.mark.parametrize("specs", SPLIT_CASES)
@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_the_native_kernel_reads_the_blocks_in_place_as_the_rows_laid_out(specs, L, with_sinks):
    """Rows of mixed lengths (one still without a block, one long enough to
    be split across threads): the native decode kernel, which reads the
    pool through the tables and the exact sinks and tails in place, gives
    what attention over each row laid out gives."""
    if not attention._native():
        pytest.skip("native kernels not built")
    ks, vs = specs
    pool = BlockPool(32, ks, vs)
    rng = np.random.default_rng(L)
    H, NQ, D = 2, 6, 64
    rows = [KVQPagedSplitSequence(pool) for _ in range(3)]
    batch = KVQPagedSplitSequence.merge(rows)

    def kv(n):
        k = rng.standard_normal((3, H, n, D)).astype(np.float32)
        k[..., 5] += 6.0  # an outlier channel, as real keys have
        return mx.array(k), mx.array(rng.standard_normal((3, H, n, D)).astype(np.float32))

    batch.prepare(lengths=[2100, 20, 300], right_padding=[0, 2080, 1800])
    batch.update_and_fetch(*kv(2100))
    batch.finalize()
    kk, vv = batch.update_and_fetch(*kv(L))
    assert isinstance(kk, PagedSplitKV) and kk.blocks[1] == 0 < kk.blocks[2] < kk.blocks[0]
    q = mx.array(rng.standard_normal((3, NQ, L, D)).astype(np.float32))
    s = mx.array(np.linspace(-1, 1, NQ).astype(np.float32)) if with_sinks else None
    got = attention.paged_split_attention(q, kk, vv, D**-0.5, "causal" if L > 1 else None, s)
    want = attention.split_rows_attention(
        q, kk.rows(), vv.rows(), D**-0.5, "causal" if L > 1 else None, s
    )
    assert got.shape == want.shape == (3, NQ, L, D)
    assert mx.abs(got - want).max().item() < 1e-5


@pytest.mark.parametrize("specs", SPLIT_CASES)
def test_decode_steps_in_the_tail_buffer_hold_what_each_row_alone_holds(specs):
    """Rows of three lengths decode 90 steps one token at a time, two of
    every seven taken back (the batch's tail buffer, written for every row at
    once, grown, its rows flushed at different steps, trimmed in place) and
    hold, token for token, what each row written and trimmed alone holds; attention over the buffer gives what attention over the rows laid
    out gives."""
    ks, vs = specs
    rng = np.random.default_rng(3)
    H, D, lengths, steps = 2, 64, (3, 10, 20), 90

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)

    prompts = [(arr(1, H, n, D), arr(1, H, n, D)) for n in lengths]
    tokens = [(arr(3, H, 1, D), arr(3, H, 1, D)) for _ in range(steps)]

    def sequences(pool):
        out = []
        for k, v in prompts:
            seq = KVQPagedSplitSequence(pool)
            seq.write(k, v)
            out.append(seq)
        return out

    def same_attention(kk, vv):
        if not attention._native():
            return
        assert isinstance(kk, PagedSplitKV)
        q = arr(3, 6, 1, D).astype(mx.float32)
        got = attention.paged_split_attention(q, kk, vv, D**-0.5, None, None)
        want = attention.split_rows_attention(q, kk.rows(), vv.rows(), D**-0.5)
        assert mx.abs(got - want).max().item() < 1e-5

    together = KVQPagedSplitSequence.merge(sequences(BlockPool(32, ks, vs)))
    alone = sequences(BlockPool(32, ks, vs))  # written and trimmed one by one
    caps, trimmed = set(), 0
    for step, (k, v) in enumerate(tokens):
        kk, vv = together.update_and_fetch(k, v)
        for i, row in enumerate(alone):
            row.write(k[i : i + 1], v[i : i + 1])
        caps.add(together.buffer[0].shape[2])
        if step % 7 == 6:  # a rejected draft of two tokens
            before, inside = together.buffer, min(together.counts) >= 2
            assert together.trim(2) == 2 and all(row.trim(2) == 2 for row in alone)
            trimmed += 2
            if inside:  # within every row's tail: the buffer is kept as it is
                assert together.buffer[0] is before[0] and together.buffer[1] is before[1]
        if step == 0:  # no row has a block yet: the kernel reads the tails alone
            assert together.pool.storage.keys is None
            same_attention(kk, vv)
    residual = together.pool.storage.residual
    assert max(caps) <= residual + 32 and (len(caps) > 1 or not residual)  # grown, bounded
    assert together._lengths() == [n + steps - trimmed for n in lengths]
    for i, row in enumerate(alone):
        got, want = together.extract(i).held(), row.held()
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and mx.array_equal(g, w).item()
    same_attention(kk, vv)


def test_a_batch_left_by_its_longest_row_holds_the_slots_the_budget_prices():
    """The tail buffer gives every row the longest tail's slots; when that
    row leaves, the buffer is cut back to the rows left (what the budget
    prices a decoding row at, `tail_slots` of the longest), their
    tokens kept."""
    ks, vs = QuantSpec(4, 32, per_channel=True, residual=8), QuantSpec(4, 32, residual=8)
    rng = np.random.default_rng(5)

    def arr(n):
        return mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32)).astype(mx.float16)

    pool = BlockPool(32, ks, vs)
    rows = []
    for n in (3, 39):
        seq = KVQPagedSplitSequence(pool)
        seq.write(arr(n), arr(n))
        rows.append(seq)
    short = rows[0].held()
    batch = KVQPagedSplitSequence.merge(rows)
    assert batch.counts == [3, 39] and batch.buffer[0].shape[2] == 40  # residual + block
    batch.filter([0])
    assert batch.buffer[0].shape[2] == tail_slots(3, 8, 32) == 32
    for got, want in zip(batch.extract(0).held(), short, strict=True):
        assert mx.array_equal(got, want).item()


def test_the_native_kernel_reads_bfloat16_rows():
    """A bfloat16 model's exact sinks and tails and scales are bfloat16: the
    kernel converts them as bfloat16 (the high half of a float32)."""
    if not attention._native():
        pytest.skip("native kernels not built")
    pool = BlockPool(32, *SPLIT_CASES[0])
    rng = np.random.default_rng(7)
    batch = KVQPagedSplitSequence.merge([KVQPagedSplitSequence(pool) for _ in range(2)])

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    batch.update_and_fetch(arr(2, 2, 100, 64), arr(2, 2, 100, 64))
    kk, vv = batch.update_and_fetch(arr(2, 2, 1, 64), arr(2, 2, 1, 64))
    assert kk.tail.dtype == kk.sinks[0].dtype == kk.pool.scales.dtype == mx.bfloat16
    q = arr(2, 6, 1, 64)
    got = attention.paged_split_attention(q, kk, vv, 0.125, None, None).astype(mx.float32)
    want = attention.split_rows_attention(q, kk.rows(), vv.rows(), 0.125).astype(mx.float32)
    assert got.dtype == mx.float32 and mx.abs(got - want).max().item() < 2e-2
    assert mx.abs(want).max().item() > 0.1


@pytest.mark.parametrize(("flags", "want"), [([], AUTO_BLOCK_SIZE), (["--kv-block-size", "0"], None),
                                             (["--kv-block-size", "64"], 64)])  # fmt: skip
def test_serve_takes_the_plans_block_size_unless_told(flags, want):
    args = build_parser().parse_args(["serve", "--model", "demo", *flags])
    assert engine_options(args, None, None).block_size == want


def test_the_generation_functions_take_every_kv_keyword(tmp_path):
    """`make_prompt_cache` and `generate_step` take every KV keyword that
    `generate` and the CLI take (`KVConfig.as_kwargs`), the split layout's
    included, and honour them."""
    for fn in (mlx_kvq.make_prompt_cache, mlx_kvq.generate_step):
        missing = set(KV_KEYS) - set(inspect.signature(fn).parameters)
        assert not missing, (fn.__name__, missing)
    model = _tiny()
    cache = mlx_kvq.make_prompt_cache(model, **_cfg(4).as_kwargs())
    assert {type(c) for c in cache} == {KVQSplitCache}
    assert cache[0].store.sinks == 4
    steps = mlx_kvq.generate_step(TOKENS[0, :40], model, max_tokens=2, **_cfg(4).as_kwargs())
    assert len(list(steps)) == 2
