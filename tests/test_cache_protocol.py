"""Every cache leaf a tool can reach has mlx-lm's cache protocol.

mlx-lm's tools (prompt-cache files, trimming, byte counts) walk a prompt
cache as it defines one: a list of caches, containers listing their members
in `.caches`, each member a cache (`state`, `from_state`, `is_trimmable`,
`size`, `empty`, `nbytes`). Checked for the quantized caches of every
architecture in the catalogue, after a short prefill.
"""

from __future__ import annotations

import mlx.core as mx
from kvq_testing import archs
from mlx.utils import tree_flatten

import mlx_kvq


def walk(cache) -> list:
    """Every cache reachable from `cache`, containers included, as mlx-lm
    walks them (a `.caches` list or tuple is a container's members)."""
    out = [cache]
    members = getattr(cache, "caches", None)
    if isinstance(members, list | tuple):
        for member in members:
            out.extend(walk(member))
    return out


def protocol_problems(cache) -> list[str]:
    """What of mlx-lm's cache protocol `cache` lacks or breaks (empty: none)."""
    name = type(cache).__name__
    try:
        state = cache.state
        trimmable = cache.is_trimmable()
        size, empty, nbytes = cache.size(), cache.empty(), cache.nbytes
        restored = type(cache).from_state(state)
    except Exception as e:  # noqa: BLE001 - reported as the problem itself
        return [f"{name}: {type(e).__name__}: {e}"]
    problems = []
    if not isinstance(trimmable, bool) or (trimmable and not callable(cache.trim)):
        problems.append(f"{name}: is_trimmable() -> {trimmable!r}")
    if not isinstance(size, int) or not isinstance(empty, bool) or not isinstance(nbytes, int):
        problems.append(f"{name}: size/empty/nbytes -> {size!r}/{empty!r}/{nbytes!r}")
    want, got = tree_flatten(state), tree_flatten(restored.state)
    same = [k for k, _ in want] == [k for k, _ in got] and all(
        (a == b).all().item() if isinstance(a, mx.array) else a == b
        for (_, a), (_, b) in zip(want, got, strict=True)
    )
    if not same:
        problems.append(f"{name}: from_state(state).state differs from state")
    return problems


def test_every_reachable_cache_leaf_has_mlx_lms_protocol():
    """Report views (deepseek_v41's open compression group) are not among them."""
    problems, kinds = [], set()
    tokens = archs.prompt_tokens()
    for name in archs.TINY_CONFIGS:
        model = archs.build_model(name)
        cache = mlx_kvq.make_prompt_cache(model, kv_bits=4)
        model(tokens[None, :12], cache=cache)
        for c in (leaf for slot in cache for leaf in walk(slot)):
            kinds.add(type(c).__name__)
            problems += [f"{name}: {p}" for p in protocol_problems(c)]
    assert {"KVQDeepseekV41Cache", "KVQCompressedRows", "KVQFullCache", "KVQWindowCache"} <= kinds
    assert not problems, "\n".join(sorted(set(problems)))


def test_a_report_view_is_not_a_cache():
    """The check above fails on a view without a state."""

    class View:
        nbytes = 0

    assert protocol_problems(View())
