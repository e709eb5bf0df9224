"""The batch runner: steps mlx-lm's batch and moves sequences in and out of it.

`BatchRunner` owns mlx-lm's `BatchGenerator` (prompts processed in chunks
by a prompt batch, then decoded together) and the speculative lane beside
it (`speculation.SpeculativeLane`). The batch's layout is chosen once
(`choose_layout`): the layers whose kind pages hold their K/V in the block
pools of `pages` (each row its own blocks, nothing padded), the others keep
mlx-lm's left-padded rows. It inserts a sequence with the cache it starts
from (written into the pools where it pages), steps the batch, takes
sequences out with their caches (finished, stopped, preempted), copies
caches at prompt cuts, and reports what the caches hold. It decides
nothing: the scheduler decides, the engine applies.

A preempted sequence leaves with its cache, the tokens that cache holds and
the token the batch has already sampled for it (`Taken.pending`; mlx-lm
samples one step ahead). The engine emits that token and resumes the
sequence later with it as its last prompt token, so greedy and seeded
sampling go on exactly where they stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences, generation_stream
from mlx_lm.sample_utils import greedy_sampler

from mlx_kvq.attention import log_softmax
from mlx_kvq.caches import (
    KVQWindowCache,
    Pages,
    PagesStats,
    cache_report,
    mapped_blocks,
    page_caches,
    paged_block_size,
    paging_refusal,
    split_unpaged,
    unpage_caches,
)
from mlx_kvq.config import AUTO_BLOCK_SIZE, PAGED_BLOCK_SIZE, UnsupportedKVConfig, is_split
from mlx_kvq.mlx_lm_internals import (
    batch_caches,
    chunk_limit,
    cut_segment,
    decode_with,
    decoding_caches,
    pending_token,
    prompt_chunks,
)

from .scheduler import Sequence
from .speculation import DraftModel, LaneWork, SpeculativeLane


@dataclass(frozen=True)
class Taken:
    """A sequence taken out of the batch or the lane: the cache it held (None
    if it had none yet), the tokens that cache holds, and the token already
    sampled for its next step with its log-probabilities (None if none)."""

    cache: list | None
    tokens: list[int]
    pending: tuple[int, Any] | None = None


@dataclass(frozen=True)
class BatchStep:
    """What one step of the batch did: mlx-lm's prompt and generation responses."""

    prompt: tuple
    tokens: tuple
    prompt_tokens: int
    prompt_time: float
    generation_tokens: int
    decode_time: float


@dataclass(frozen=True)
class Layout:
    """How the batch lays out K/V: block pools for the layers in `paged`
    ((slot, member) keys), mlx-lm's left-padded rows for the others."""

    block_size: int | None  # None: padded rows for every layer
    paged: frozenset
    description: str


def choose_layout(plan: Any, block_size: int | str | None, on_disk: bool = False) -> Layout:
    """The paged layout for every layer of `plan` whose kind pages (declared in
    the registry), unless `block_size` is None or the model is declared unpaged.
    `AUTO_BLOCK_SIZE`: the plan's own block size (`paged_block_size`).
    `on_disk` (the prompt cache's disk tier, which keeps no split-layout layer
    in blocks): split layers keep padded rows under the plan's block size,
    and an explicit block size that would page one is refused."""
    layout = _paged_layout(plan, block_size)
    paged_split = [
        p for p in plan.kv_layers
        if (p.slot, p.member) in layout.paged and is_split(p.key_spec, p.value_spec)
    ]  # fmt: skip
    if not (on_disk and paged_split):
        return layout
    if block_size != AUTO_BLOCK_SIZE:
        raise UnsupportedKVConfig(
            f"--prompt-cache-dir keeps no layer in the paged split layout, and --kv-block-size "
            f"{block_size} pages the split layers of this setting; leave --kv-block-size out "
            "(the disk tier then keeps padded rows) or pass --kv-block-size 0"
        )
    return Layout(
        None, frozenset(), "padded rows: the disk tier (--prompt-cache-dir) keeps no layer in "
        "the paged split layout"
    )  # fmt: skip


def _paged_layout(plan: Any, block_size: int | str | None) -> Layout:
    if block_size is None:
        return Layout(None, frozenset(), "padded rows (paging turned off)")
    if block_size == AUTO_BLOCK_SIZE:
        block_size = paged_block_size(
            (p.kind, p.window, p.key_spec, p.value_spec) for p in plan.kv_layers
        )
    refusal = paging_refusal(plan.model_type)
    if refusal:
        return Layout(None, frozenset(), f"padded rows: {plan.model_type} {refusal}")
    probe = Pages(block_size)
    page_caches(plan.make_cache(), probe)
    kv = len(plan.kv_layers)
    unpaged: dict[str, list[str]] = {}  # why -> the layers kept padded for it
    for p in plan.kv_layers:
        if (p.slot, p.member) not in probe.pools:
            why = split_unpaged(p.kind, p.window, p.key_spec, p.value_spec, block_size)
            if why:
                unpaged.setdefault(why, []).append(str(p.slot))
    why = "; ".join(
        f"layer{'s' * (len(layers) > 1)} {', '.join(layers)}: {reason}"
        for reason, layers in unpaged.items()
    )
    why = f" (in the split layout, {why})" if why else ""
    if not probe.pools:
        return Layout(None, frozenset(), f"padded rows: none of its KV layers pages{why}")
    return Layout(
        block_size,
        frozenset(probe.pools),
        f"paged: {len(probe.pools)} of {kv} KV layers in blocks of {block_size} tokens"
        + ("" if len(probe.pools) == kv else f"; the others keep padded rows{why}"),
    )


@dataclass(frozen=True)
class WarmupRun:
    """What the warm-up batch left: the decoding batch's cache report at its
    last step with the long sequence, the report of that sequence's extracted cache and
    its length, the width of the model's logits, and the most sequences that
    decoded in one step."""

    batch_report: list
    longest_report: list
    longest: int
    vocab: int
    rows: int


@dataclass(frozen=True)
class LaneWarmupRun:
    """What the warm-up sequence on the lane left: both models' cache reports,
    the (slots held, window) of every window cache, tokens generated and
    drafted tokens accepted."""

    target_report: list
    draft_report: list
    windows: list
    generated: int
    accepted: int


@dataclass(frozen=True)
class RunnerOptions:
    decode_rows: int = 32
    prompt_rows: int = 8
    prefill_step: int = 2048
    block_size: int | None = PAGED_BLOCK_SIZE  # tokens per block (None: padded rows)


class BatchRunner:
    """mlx-lm's batch and the speculative lane; see the module docstring."""

    def __init__(self, model: Any, options: RunnerOptions, draft: DraftModel | None):
        self.model = model
        self.options = options
        self.rows: dict[int, Sequence] = {}  # by batch uid
        # The paged layout: block pools of the layers that page (None: mlx-lm's
        # left-padded rows for every layer).
        self.pages = None if options.block_size is None else Pages(options.block_size)
        self.lane = None if draft is None else SpeculativeLane(model, draft, options.prefill_step)
        self._bg: BatchGenerator | None = None

    # ------------------------------------------------------------ the batch
    def open(self) -> None:
        """Make the batch (on the engine thread: MLX streams belong to threads)."""
        self._bg = BatchGenerator(
            self.model,
            completion_batch_size=self.options.decode_rows,
            prefill_batch_size=self.options.prompt_rows,
            prefill_step_size=self.options.prefill_step,
        )
        decode_with(self._bg, log_softmax)

    def close(self) -> None:
        """Drop the batch, after the work it queued has run: evaluation left
        pending on a stream when the process exits aborts it in MLX's
        teardown ("terminate called without an active exception")."""
        mx.synchronize(generation_stream)
        mx.synchronize()
        self._bg = None
        self.rows.clear()
        if self.lane is not None:
            self.lane.drop()

    @property
    def generator(self) -> BatchGenerator | None:
        return self._bg

    def for_batch(self, cache: list, account: int | None = None) -> list:
        """`cache` in the batch's layout: pageable slots in the block pools (a
        paged cache from the prompt cache already maps its blocks there), held
        for `account` (the request)."""
        return cache if self.pages is None else page_caches(cache, self.pages, account)

    def for_lane(self, cache: list) -> list:
        """`cache` in the layout the speculative lane runs (its own caches)."""
        return cache if self.pages is None else unpage_caches(cache)

    def pages_stats(self) -> PagesStats | None:
        return None if self.pages is None else self.pages.stats()

    def insert(
        self,
        seq: Sequence,
        pieces: list[list[int]],
        cache: list,
        held: list[int],
        max_tokens: int,
        stop: StopSequences,
    ) -> int:
        """Add `seq` to the batch: `cache` holds `held`, `pieces` are the tokens
        still to process (the last one starts decoding), `stop` the tokens that
        end it (EOS). Returns the pool blocks it maps by reference (a paged
        prompt-cache copy's)."""
        reused = mapped_blocks(cache)
        cache = self.for_batch(cache, seq.id)
        (uid,) = self._bg.insert_segments(
            [pieces],
            max_tokens=[max_tokens],
            caches=[cache],
            all_tokens=[held],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
            stop_sequences=[stop],
        )
        seq.uid = uid
        self.rows[uid] = seq
        return reused

    def cut(self, seq: Sequence, length: int) -> tuple[int, bool] | None:
        """End a piece of `seq`'s prompt still to process after its first
        `length` tokens, where the batch hands back a copy of its caches: how
        many of its piece ends still to come are before it, and whether the
        cut was made now (False: a piece ends there already); None when it
        is past that point."""
        if seq.uid is None or seq.uid not in self.rows:
            return None
        return cut_segment(self._bg, seq.uid, len(seq.tokens) - length)

    def remove(self, seqs: list[Sequence], keep_caches: bool = False) -> dict[int, tuple]:
        """Take `seqs` out of the batch; their (cache, tokens) by request id
        when `keep_caches`."""
        uids = [s.uid for s in seqs if s.uid is not None and s.uid in self.rows]
        if not uids:
            return {}
        by_uid = {uid: self.rows.pop(uid) for uid in uids}
        for seq in by_uid.values():
            seq.uid = None
        out = self._bg.remove(uids, return_prompt_caches=keep_caches)
        return {by_uid[uid].id: v for uid, v in out.items()}

    def forget_row(self, uid: int) -> None:
        """mlx-lm's batch took row `uid` out itself (its sequence finished)."""
        seq = self.rows.pop(uid, None)
        if seq is not None:
            seq.uid = None

    def discard(self, seq: Sequence) -> None:
        """`seq` leaves wherever it runs (a batch row, the lane), its caches dropped."""
        if seq.uid is not None:
            self.remove([seq])
        elif self.on_lane(seq):
            self.lane.drop()

    def take_out(self, seq: Sequence) -> Taken:
        """Take `seq` out for preemption: its cache, the tokens it holds, and the
        token already sampled for it (see the module docstring)."""
        uid = seq.uid
        pending = pending_token(self._bg, uid) if uid is not None else None
        held = self.remove([seq], keep_caches=pending is not None).get(seq.id)
        if held is None:
            return Taken(None, [])
        cache, tokens = held
        return Taken(cache, list(tokens), pending)

    def extract(self, seqs: list[Sequence]) -> dict[int, tuple]:
        """Copies of `seqs`' caches as they are now and the tokens they hold, by request id."""
        by_uid = {s.uid: s for s in seqs if s.uid is not None}
        if not by_uid:
            return {}
        return {by_uid[u].id: v for u, v in self._bg.extract_cache(list(by_uid)).items()}

    def step(self) -> BatchStep:
        # Every prompt of a step takes the same number of tokens: mlx-lm pads
        # the step's chunks to the longest and computes the padding, so a
        # 2,048-token chunk of a long prompt beside short ones would cost the
        # short ones 2,048 tokens each. The long prompt waits a step instead.
        chunk = min([self.options.prefill_step, *prompt_chunks(self._bg)])
        with chunk_limit(self._bg, chunk), self._bg.stats() as stats:
            prompt, tokens = self._bg.next()
        return BatchStep(
            tuple(prompt), tuple(tokens), stats.prompt_tokens, stats.prompt_time,
            stats.generation_tokens, stats.decode_time,
        )  # fmt: skip

    # ------------------------------------------------------------ what is held
    @property
    def lane_busy(self) -> bool:
        return self.lane is not None and self.lane.busy

    def on_lane(self, seq: Sequence) -> bool:
        """Whether the speculative lane holds `seq`'s caches (the one answer to
        where a sequence runs besides its batch row, `seq.uid`)."""
        return self.lane is not None and self.lane.owner is seq

    def caches(self) -> list:
        """Every cache live sequences hold: the batch's and the speculative lane's."""
        batch = [] if self._bg is None else batch_caches(self._bg)
        return batch + (self.lane.caches() if self.lane_busy else [])

    def live_bytes(self) -> int:
        """KV bytes live sequences hold (batch, lane, draft model), measured;
        with the paged layout, the pool blocks something besides the prompt
        cache refers to (each block once), what paged caches hold beside
        their pool (`own_nbytes`) and the other layers' caches."""
        lane = self.lane.nbytes if self.lane_busy else 0
        if self.pages is not None:
            batch = [] if self._bg is None else batch_caches(self._bg)
            own = sum(
                c.own_nbytes if getattr(c, "shares_storage", False) else c.nbytes for c in batch
            )
            blocks = sum(p.allocator.live * p.block_bytes for p in self.pages.pools.values())
            return blocks + own + lane
        batch = 0 if self._bg is None else self._bg.prompt_cache_nbytes
        return batch + lane

    # ------------------------------------------------------------ the lane
    def lane_step(self) -> LaneWork:
        return self.lane.step()

    # ------------------------------------------------------------ warm-up
    def warm_up(
        self,
        first: list[int],
        first_tokens: int,
        joining: list[list[int]],
        max_tokens: int,
        make_cache: Callable[[], list],
    ) -> WarmupRun:
        """Run `first` greedily through the batch for `first_tokens` and, once
        it decodes, insert `joining` together (right-padded, then merged into
        the running batch) for `max_tokens` each (no EOS: every step runs), as
        requests go."""

        def insert(prompts: list[list[int]], n: int) -> list[int]:
            return self._bg.insert(
                prompts,
                max_tokens=[n] * len(prompts),
                caches=[self.for_batch(make_cache()) for _ in prompts],
                samplers=[greedy_sampler] * len(prompts),
                stop_sequences=[StopSequences()] * len(prompts),
            )

        uids = list(insert([first], first_tokens))
        waiting = joining
        batch_report: list[dict] = []
        finished: dict[int, tuple[list, int]] = {}
        vocab = rows = 0
        while len(finished) < len(uids):
            _, responses = self._bg.next()
            rows = max(rows, len(responses))
            for r in responses:
                vocab = r.logprobs.shape[-1]
                if r.finish_reason is not None:
                    finished[r.uid] = (r.prompt_cache, len(r.all_tokens))
            decoding = decoding_caches(self._bg)
            if decoding and uids[0] not in finished:  # the batch decoding the long sequence
                batch_report = cache_report(decoding)
            if waiting and responses:
                uids += insert(waiting, max_tokens)
                waiting = []
        longest_cache, longest = max(finished.values(), key=lambda x: x[1])
        return WarmupRun(batch_report, cache_report(longest_cache), longest, vocab, rows)

    def warm_up_lane(
        self, prompt: list[int], cache: list, num_draft_tokens: int, want: int
    ) -> LaneWarmupRun:
        """One greedy sequence through the lane, prefilling `prompt` and drafting
        until `want` tokens; the lane is free again afterwards."""
        lane = self.lane
        lane.start(
            "warm-up", prompt, cache, 0,
            max_tokens=want, num_draft_tokens=num_draft_tokens, sampler=greedy_sampler,
        )  # fmt: skip
        generated = accepted = 0
        for _ in range(len(prompt) + want):  # prefill chunks, then cycles of at least one token
            work = lane.step()
            generated += len(work.tokens)
            accepted += sum(t.from_draft for t in work.tokens)
            if generated >= want:
                break
        target, draft = lane.model_cache, lane.draft_cache
        windows = [
            (c.keys.length, c.max_size)
            for c in target + draft
            if isinstance(c, KVQWindowCache) and c.keys is not None
        ]
        run = LaneWarmupRun(cache_report(target), cache_report(draft), windows, generated, accepted)
        lane.take(generated)
        return run


__all__ = ["BatchRunner", "BatchStep", "LaneWarmupRun", "RunnerOptions", "Taken", "WarmupRun"]
