"""The KV memory budget's prices and bounds: what a batch of sequences holds.

A request is admitted when what its sequence holds (its prompt and a small
decode reserve) fits beside what the admitted sequences hold now; sequences
grow as they decode (`memory.py`, `scheduler.py`). What a set of sequences
holds is an upper bound computed from the plan (`CostModel`), and it has to
know how mlx-lm's `BatchGenerator` lays sequences out, because a batch is
not a sum of independent caches:

- Rows are left-padded to a common length. A decoding batch (the
  generation batch) is as long as its longest sequence: full-attention
  layers hold `rows x (longest content + 255)` slots (the caches grow in
  256-token steps, `KVQCache.step`, and filtering a batch cuts the padding
  no row needs). A sequence's content is at most the total its shape
  allows (its tokens so far and its decode reserve).
- Sliding-window layers hold at most `window` slots per row while decoding
  (a batch window is not cut back when long rows leave, so the bound is the
  window, not the longest row).
- Prompts are processed in chunks of `--prefill-step-size` tokens by a
  separate batch of at most `--prompt-concurrency` rows (the engine admits
  no more than that many prompts at once). There a window holds
  `window - 1 + chunk` slots (the chunk's keys must all be visible to its
  queries, as in mlx-lm's rotating cache), and full layers can carry up to
  one chunk of extra padding (rows that finish their prompt in a shorter
  last chunk) until they move to the generation batch. Only rows in their
  prompt are charged for it.
- Before `--quantized-kv-start` tokens the caches are raw (the model's
  dtype), after it quantized: both are bounded.

With the paged layout (`caches/paged/`) the layers that page hold no
padding, and their memory is not priced here: the block pools are the
truth (`Pages`: blocks live, blocks only the prompt cache keeps, blocks
promised to admitted requests), and a set of sequences fits when the
blocks they hold and were promised, priced at each slot's bytes per block,
fit beside the padded slots' bound. What one sequence is promised is what
the paged forms hold at most (`blocks_held`: its tokens in whole blocks; a
window at most `window - 1` tokens before the chunk it writes, plus its
partly used first block; a split row, the tokens `residual` or more before
its end). A split row's exact tokens are held beside the pools, in its
batch's tail buffer, whose rows all get the longest tail's slots: they are
priced at the longest admitted row's slots (`beside_pools`), since a row
joins the decoding batch without asking the budget. Layers that keep their
own layout are priced as above.

`CostModel.bound(shapes, prompting)` is the bound for a set of sequences
(the capacity line, a prompt that never fits), `Ledger` keeps the admitted
shapes of each rank and decides admission and growth with the pools'
truth, and the engine measures what the caches really hold after every step
(`Ledger.check`) against both the budget and the bound.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from mlx_kvq.caches import KVQCache, Pages, blocks_held, tail_slots
from mlx_kvq.config import KVConfig, QuantSpec, is_split
from mlx_kvq.plan import KVPlan, LayerPlan

GROWTH = KVQCache.step  # the padded caches grow their buffers in steps of this many tokens
CPU_RAM_SHARE = 0.5  # default budget without Metal: this share of RAM, less the weights
METAL_SHARE = 0.9  # with Metal: this share of the recommended working set, less the weights
CAPACITY_TOKENS = 8192  # the capacity line counts sequences of this many tokens (or the context)
LONGEST_PROBE = 1 << 20  # the longest sequence the capacity line looks for, without a context


@dataclass(frozen=True)
class Shape:
    """What one sequence may hold: its prompt, and the tokens it may reach (its total)."""

    prompt: int
    total: int


def _counts(shapes: Iterable[Shape]) -> Counter[Shape]:
    """Sequences as counts of their shapes: a bound is linear in each shape's count."""
    return shapes if isinstance(shapes, Counter) else Counter(shapes)


@dataclass(frozen=True)
class SlotCost:
    """One KV cache slot of the plan as the budget prices it."""

    window: int | None  # None: full attention (grows with the sequence)
    stored: int  # bytes per token as stored (quantized where the plan quantizes)
    raw: int  # bytes per token in the model's dtype (before quantized_kv_start)
    paged: bool = False  # held in a block pool (the paged layout)
    key: tuple[int, int | None] = (0, None)  # its (slot, member): the key of its pool
    # paged split layout: bytes per token of what a row holds exact beside its
    # blocks (its sinks and its tail, 16-bit; 0: nothing), and their counts
    exact: int = 0
    sinks: int = 0
    residual: int = 0
    # padded split layout: bytes a row holds at most beyond `stored` per token
    # (`split_extra`)
    extra: int = 0


@dataclass(frozen=True)
class CostModel:
    """Upper bounds of the bytes a batch of sequences holds; see the module docstring."""

    slots: tuple[SlotCost, ...]
    state_bytes: int = 0  # recurrent state per sequence (not KV)
    quantized_start: int = 0
    prefill_step: int = 2048
    prompt_rows: int = 8
    setting: str = ""  # the KV setting in words, e.g. "K4/V3"
    block_size: int = 0  # tokens per block of the paged slots (0: none page)

    @classmethod
    def from_plan(
        cls,
        plan: KVPlan,
        *,
        prefill_step: int,
        prompt_rows: int,
        quantized: bool = True,
        paged: frozenset = frozenset(),
        block_size: int = 0,
    ) -> CostModel:
        """Costs of `plan`'s slots; `quantized=False` prices the same model
        unquantized; `paged`: the (slot, member) keys held in block pools of
        `block_size` tokens."""
        slots = []
        for p in plan.kv_layers:
            raw = _per_token(p, QuantSpec(None), QuantSpec(None))
            keep = quantized and not p.skipped
            stored = _per_token(p, p.key_spec, p.value_spec) if keep else raw
            key = (p.slot, p.member)
            exact = extra = sinks = residual = 0
            if keep and is_split(p.key_spec, p.value_spec):
                per_token = p.kv_heads * (p.key_dim + p.value_dim) * 2  # held in 16 bits
                if key in paged:
                    exact = per_token
                    sinks = max(p.key_spec.sinks, p.value_spec.sinks)
                    residual = max(p.key_spec.residual, p.value_spec.residual)
                else:
                    extra = split_extra(p, stored, per_token)
            slots.append(SlotCost(p.window, stored, raw, key in paged, key, exact=exact,
                                  sinks=sinks, residual=residual, extra=extra))  # fmt: skip
        state = sum(p.state_bytes for p in plan.layers if p.kind == "state")
        return cls(
            tuple(slots), state, plan.config.quantized_start if quantized else 0,
            max(1, prefill_step), max(1, prompt_rows),
            setting_label(plan.config) if quantized else "unquantized",
            block_size if paged else 0,
        )  # fmt: skip

    # -- the paged slots ---------------------------------------------------------
    def promise(
        self, shape: Shape, prompting: bool, cached: int = 0
    ) -> dict[tuple[int, int | None], int]:
        """The blocks one sequence holds at most in each paged slot's pool (in
        its prompt, a window holds a prompt chunk besides: of the tokens after
        the `cached` it starts from)."""
        chunk = min(self.prefill_step, max(1, shape.prompt - cached)) if prompting else 1
        return {
            s.key: blocks_held(self._in_blocks(s, shape.total), self.block_size, s.window, chunk)
            for s in self.slots
            if s.paged
        }

    @staticmethod
    def _in_blocks(s: SlotCost, tokens: int) -> int:
        """The most of a row's `tokens` that slot `s` holds in blocks: a split
        row's blocks end `residual` tokens or more before its end."""
        return max(0, tokens - s.residual) if s.exact else tokens

    def block_bytes(self, key: tuple[int, int | None]) -> int:
        """Bytes of one block of the paged slot `key`."""
        return next(s.stored for s in self.slots if s.key == key) * self.block_size

    def blocks_bytes(self, blocks: dict[tuple[int, int | None], int]) -> int:
        return sum(n * self.block_bytes(key) for key, n in blocks.items())

    def paged_bound(self, shapes: Iterable[Shape], prompting: Iterable[Shape] = ()) -> int:
        """What these sequences hold at most in the block pools (the rows of
        `prompting` in their prompt), each block once per holder, and beside
        them (`beside_pools`)."""
        if not self.block_size:
            return 0
        shapes, in_prompt = _counts(shapes), _counts(prompting)
        total = self.beside_pools(shapes)
        for shape, n in shapes.items():
            p = min(n, in_prompt[shape])
            if p:
                total += p * self.blocks_bytes(self.promise(shape, True))
            if n > p:
                total += (n - p) * self.blocks_bytes(self.promise(shape, False))
        return total

    def beside_pools(self, shapes: Iterable[Shape]) -> int:
        """What paged split-layout rows hold exact beside the pools, in 16 bits:
        each row's sinks and its slots of its batch's tail buffer, as many as
        the batch's longest tail gets (`tail_slots`). Every row is priced at
        the longest row's slots: a row moves from its prompt's batch into the
        decoding one without asking the budget, and there takes the slots of
        the longest row in it."""
        slots = [s for s in self.slots if s.paged and s.exact]
        shapes = _counts(shapes)
        if not slots or not shapes:
            return 0
        longest, rows = max(shape.total for shape in shapes), shapes.total()
        return sum(
            s.exact * rows * (s.sinks + tail_slots(longest, s.residual, self.block_size))
            for s in slots
        )

    # -- one slot ------------------------------------------------------------
    def slot_bytes(self, s: SlotCost, n: int) -> int:
        """Bytes of `n` buffer slots, raw before quantized_kv_start, stored after
        (and what a split-layout row holds beside them)."""
        b = s.stored * n + s.extra
        if self.quantized_start and s.raw > s.stored:
            b = max(b, s.raw * min(n, self.quantized_start + self.prefill_step + GROWTH))
        return b

    def _shape_bytes(self, full: int, window_extra: int | None) -> int:
        """One row: `full` slots in full-attention layers; windows at their size,
        plus `window_extra` - 1 slots while a prompt chunk is in them."""
        total = self.state_bytes
        for s in self.slots:
            if s.paged:
                continue
            if s.window is None:
                n = full
            elif window_extra is None:
                n = s.window
            else:
                n = s.window - 1 + window_extra
            total += self.slot_bytes(s, n)
        return total

    # -- sets of sequences -------------------------------------------------
    def row_bounds(self, longest_total: int, longest_prompt: int) -> tuple[int, int]:
        """(decoding row, prompt row): what one row can hold in a batch whose
        longest sequence totals `longest_total` tokens and longest prompt has
        `longest_prompt`."""
        chunk = min(self.prefill_step, longest_prompt)
        decoding = self._shape_bytes(longest_total + GROWTH - 1, None)
        prompting = self._shape_bytes(longest_prompt + chunk + GROWTH - 1, chunk)
        return decoding, prompting

    def bound(self, shapes: Iterable[Shape], prompting: Iterable[Shape] | None = None) -> int:
        """The most a batch of these sequences holds at any step boundary, the
        rows of `prompting` (default: any of them) in their prompt."""
        shapes = _counts(shapes)
        prompting = shapes if prompting is None else _counts(prompting)
        return self.paged_bound(shapes, prompting) + self.padded_bound(shapes, prompting)

    def padded_bound(self, shapes: Iterable[Shape], prompting: Iterable[Shape]) -> int:
        """`bound` of the slots that keep mlx-lm's left-padded rows (and the
        recurrent state)."""
        shapes, prompting = _counts(shapes), _counts(prompting)
        if not shapes:
            return 0
        n = shapes.total()
        longest = max(s.total for s in shapes)
        decoding, _ = self.row_bounds(longest, 1)
        if not prompting:
            return n * decoding
        _, in_prompt = self.row_bounds(longest, max(s.prompt for s in prompting))
        rows = min(prompting.total(), n, self.prompt_rows)
        return n * decoding + rows * max(0, in_prompt - decoding)

    def entry_bytes(self, tokens: int) -> int:
        """The most a prompt-cache entry covering `tokens` tokens holds (extracted
        from a decoding or a prompt batch)."""
        total = self.state_bytes
        for s in self.slots:
            if s.paged:  # an entry keeps what its next token sees (`window.py`)
                blocks = blocks_held(self._in_blocks(s, tokens), self.block_size, s.window, chunk=0)
                total += blocks * self.block_bytes(s.key)
                # and exact beside its blocks: its sinks and a tail of its own
                total += s.exact * (s.sinks + min(tokens, s.residual + self.block_size))
            else:
                n = tokens if s.window is None else min(tokens, s.window - 1 + self.prefill_step)
                total += self.slot_bytes(s, n)
        return total

    def sequences(self, budget: int, shape: Shape) -> int:
        """How many sequences of `shape` a budget of `budget` bytes holds at once."""
        if self.block_size:

            def fits(n: int) -> bool:
                counts = Counter({shape: n})
                return self.bound(counts, Counter({shape: min(n, self.prompt_rows)})) <= budget

            lo, hi = 0, 1
            while fits(hi):
                lo, hi = hi, hi * 2
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            return lo
        decoding, prompting = self.row_bounds(shape.total, shape.prompt)
        first = max(decoding, prompting)  # the rows that may be in their prompt
        if first <= 0:
            return 0
        n = budget // first
        if n <= self.prompt_rows:
            return int(n)
        left = budget - self.prompt_rows * first
        return int(self.prompt_rows + left // max(decoding, 1))

    def unquantized(self) -> CostModel:
        """The same slots unquantized: raw bytes per token, and none of what a
        split-layout row holds exact beside its tokens."""
        slots = tuple(replace(s, stored=s.raw, exact=0, extra=0) for s in self.slots)
        return CostModel(slots, self.state_bytes, 0, self.prefill_step, self.prompt_rows,
                         "unquantized", self.block_size)  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CostModel:
        d = dict(d)
        d["slots"] = tuple(
            SlotCost(**{**s, "key": tuple(s.get("key", (0, None)))}) for s in d["slots"]
        )
        return cls(**d)


def split_extra(p: LayerPlan, stored: int, exact: int) -> int:
    """What a split-layout row in padded rows holds at most beyond `stored`
    bytes per token (`mlx_kvq/split.py`), `exact` being a token's bytes in 16
    bits: its exact tokens (the sinks, and a tail of fewer than `residual` +
    a flush unit) at 16 bits instead of stored; in a window, the sinks besides
    its tokens, and up to a unit less one of body before the window (the body
    drops whole units)."""
    k, v = p.key_spec, p.value_spec
    unit = max(k.flush_unit, v.flush_unit)
    sinks = max(k.sinks, v.sinks)
    tail = max(k.residual, v.residual) + unit - 1
    if p.window is None:
        return (sinks + tail) * max(0, exact - stored)
    return sinks * exact + tail * max(0, exact - stored) + (unit - 1) * stored


def _per_token(p: LayerPlan, k: QuantSpec, v: QuantSpec) -> int:
    """Bytes one token costs in slot `p` with keys stored as `k`, values as `v`."""
    size = p.dtype_size
    return round(
        p.kv_heads
        * (p.key_dim * k.bytes_per_element(size) + p.value_dim * v.bytes_per_element(size))
    )


def setting_label(config: KVConfig) -> str:
    """The KV setting in a few characters: "K4/V3", "K4/V3, windows 8-bit",
    "K8/V8", "unquantized"."""
    if not config.enabled:
        return "unquantized"
    k, v = config.key_spec.bits, config.value_spec.bits
    label = f"K{k or 'raw'}/V{v or 'raw'}"
    if config.window_bits is not None:
        label += f", windows {config.window_bits or 'raw'}-bit"
    return label


@dataclass(frozen=True)
class Share:
    """One rank's budget (bytes) and what its sequences cost."""

    budget: int
    cost: CostModel
    unquantized: CostModel | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget": self.budget,
            "cost": self.cost.to_dict(),
            "unquantized": None if self.unquantized is None else self.unquantized.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Share:
        unq = d.get("unquantized")
        return cls(
            int(d["budget"]),
            CostModel.from_dict(d["cost"]),
            None if unq is None else CostModel.from_dict(unq),
        )


@dataclass(frozen=True)
class Capacity:
    """What a budget holds, in numbers and in words (the startup line, /health)."""

    budget: int
    tokens: int
    sequences: int
    sequences_unquantized: int | None
    setting: str
    ranks: int = 1
    longest: int | None = None  # the longest prompt one sequence holds alone (None: not computed)

    @property
    def line(self) -> str:
        where = f" per rank ({self.ranks} ranks)" if self.ranks > 1 else ""
        text = (
            f"KV budget {format_bytes(self.budget)}{where}: {self.sequences:,} sequences of "
            f"{self.tokens:,} tokens at this KV setting ({self.setting})"
        )
        if self.sequences_unquantized is not None and self.setting != "unquantized":
            text += f", {self.sequences_unquantized:,} unquantized"
        if self.longest is not None:
            text += f"; prompts of up to {self.longest:,} tokens fit"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line}


def format_bytes(n: float) -> str:
    """1.5 GiB, 320.0 MiB, 12.0 KiB, 900 B."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Verdict:
    """Whether a request's prompt can ever run, and why not."""

    fits_alone: bool
    needs: int  # bytes its prompt and decode reserve alone hold (on the rank that fits it worst)
    budget: int  # that rank's budget


@dataclass
class Ledger:
    """What the group's sequences hold (one share per rank; one for a single
    process): each admitted sequence's shape, its prompt and the tokens it
    may reach before it next grows; only the engine thread changes it.

    Every rank keeps the same ledger (the same requests are admitted, grown
    and preempted in the same order everywhere), so a group admits or grows
    a sequence only when every rank can hold it, and every rank decides it
    alike.

    With the paged layout, `pages` (this process's pools) says what the paged
    slots hold and were promised, in blocks: the same counts on every rank,
    priced at each rank's bytes per block; the shapes price the other slots.
    """

    shares: list[Share]
    me: int = 0  # this process's rank
    pages: Pages | None = None  # the paged layout's pools (None: the shapes price every slot)
    shapes: dict[int, Shape] = field(default_factory=dict)  # by request id
    prompting: set[int] = field(default_factory=set)  # ids whose prompt is being processed
    leaving: dict[int, Shape] = field(default_factory=dict)  # released after the next step
    extras: dict[int, int] = field(default_factory=dict)  # bytes beyond the shape, by request
    peak_held: int = 0
    overruns: int = 0  # steps whose measured bytes exceeded the budget (never, if the bound holds)
    bound_misses: int = 0  # steps whose live bytes exceeded the bound (a bug in the cost model)
    last_live: int = 0  # live bytes measured after the last step
    # bytes the prompt cache keeps for the sequences and cannot yield (None: none)
    kept: Callable[[], int] | None = None

    @property
    def share(self) -> Share:
        return self.shares[self.me]

    @property
    def budget(self) -> int:
        return self.share.budget

    def _bound(
        self,
        share: Share,
        swap: tuple[int, Shape] | None = None,
        new: Shape | None = None,
        extra: int = 0,
    ) -> int:
        """`share`'s bound of the ledger's rows, with one shape replaced
        (`swap`) or a new prompting row (`new`) and `extra` bytes added."""
        shapes = dict(self.shapes)
        if swap is not None:
            shapes[swap[0]] = swap[1]
        rows = list(shapes.values()) + list(self.leaving.values())
        prompting = [shapes[i] for i in self.prompting if i in shapes]
        prompting += list(self.leaving.values())
        if new is not None:
            rows.append(new)
            prompting.append(new)
        cost = share.cost
        if self.pages is None:
            held = cost.bound(rows, prompting)
        else:
            held = cost.padded_bound(rows, prompting) + self.paged(share)
            held += cost.beside_pools(rows)
        held += 0 if self.kept is None else self.kept()
        return held + sum(self.extras.values()) + extra

    def paged(self, share: Share | None = None) -> int:
        """`share`'s bytes of the blocks live sequences hold and were promised
        besides (0 without the paged layout)."""
        if self.pages is None:
            return 0
        cost = (share or self.share).cost
        return sum(
            (u.live + u.promised) * cost.block_bytes(key) for key, u in self.pages.use().items()
        )

    def padded(self) -> int:
        """This rank's bound of the slots that do not page (and of the extras)."""
        rows = list(self.shapes.values()) + list(self.leaving.values())
        prompting = [self.shapes[i] for i in self.prompting if i in self.shapes]
        prompting += list(self.leaving.values())
        held = self.share.cost.padded_bound(rows, prompting)
        if self.pages is None:
            held += self.share.cost.paged_bound(rows, prompting)
        else:
            held += self.share.cost.beside_pools(rows)
        return held + sum(self.extras.values())

    def reserved(self, rank: int | None = None) -> int:
        """Bytes the admitted sequences can hold on `rank` (default: this one)
        before any of them grows again."""
        return self._bound(self.shares[self.me if rank is None else rank])

    def fits(self, shape: Shape, extra_bytes: int = 0) -> bool:
        """Whether admitting `shape` (in its prompt, with `extra_bytes` more) now
        keeps every rank within its budget, the prompt cache yielding all it
        holds if need be (but what it keeps for the sequences, `kept`)."""
        return all(self._bound(s, new=shape, extra=extra_bytes) <= s.budget for s in self.shares)

    def verdict(self, shape: Shape) -> Verdict:
        """Whether `shape` fits even alone, on every rank."""
        worst, needs, budget = -1.0, 0, 0
        for s in self.shares:
            b = s.cost.bound([shape])
            if b / max(s.budget, 1) > worst:
                worst, needs, budget = b / max(s.budget, 1), b, s.budget
        return Verdict(worst <= 1.0, needs, budget)

    def reserve(self, request_id: int, shape: Shape, extra_bytes: int = 0) -> None:
        """Admit a request in its prompt: its shape, and `extra_bytes` it holds
        besides (a draft model's caches)."""
        self.shapes[request_id] = shape
        self.prompting.add(request_id)
        if extra_bytes:
            self.extras[request_id] = extra_bytes

    def grow(self, request_id: int, total: int, extra_bytes: int | None = None) -> bool:
        """Let an admitted sequence reach `total` tokens (and hold `extra_bytes`
        besides, when given) if every rank still fits; False otherwise."""
        held = self.shapes[request_id]
        shape = Shape(held.prompt, total)
        more = 0 if extra_bytes is None else extra_bytes - self.extras.get(request_id, 0)
        if not all(
            self._bound(s, swap=(request_id, shape), extra=more) <= s.budget for s in self.shares
        ):
            return False
        self.shapes[request_id] = shape
        if extra_bytes is not None:
            self.extras[request_id] = extra_bytes
        return True

    def prompt_done(self, request_id: int) -> None:
        """The sequence's prompt is processed: it decodes in the generation batch."""
        self.prompting.discard(request_id)

    def drop_extra(self, request_id: int) -> None:
        self.extras.pop(request_id, None)

    def release(self, request_id: int, after_step: bool = False) -> None:
        """Free a request's share: at once, or (`after_step`) once the next step
        has taken its rows out of the batch's buffers."""
        shape = self.shapes.pop(request_id, None)
        self.extras.pop(request_id, None)
        self.prompting.discard(request_id)
        if shape is not None and after_step:
            self.leaving[request_id] = shape

    def settle(self) -> None:
        """A step ran: shares released `after_step` are free now."""
        self.leaving.clear()

    def clear(self) -> None:
        self.shapes.clear()
        self.prompting.clear()
        self.leaving.clear()
        self.extras.clear()

    def room(self, rank: int | None = None) -> int:
        """Bytes the prompt cache may hold on `rank` next to what the sequences hold."""
        share = self.shares[self.me if rank is None else rank]
        return max(0, share.budget - self.reserved(rank))

    def check(self, live: int, prompt_cache: int) -> bool:
        """Measured bytes after a step against the budget and the bound; False
        (and counted) when either is exceeded."""
        held = live + prompt_cache
        self.last_live = live
        self.peak_held = max(self.peak_held, held)
        ok = True
        if held > self.budget:
            self.overruns += 1
            ok = False
        if live > self.reserved():
            self.bound_misses += 1
            ok = False
        return ok

    def capacity(self, tokens: int, context: int | None = None) -> Capacity:
        """How many sequences of `tokens` tokens the group holds at once, however
        they split into prompt and completion, and the longest prompt it holds
        (up to `context`)."""
        shape = Shape(max(1, tokens - 1), tokens)
        n = min(s.cost.sequences(s.budget, shape) for s in self.shares)
        unq = [s.unquantized for s in self.shares]
        n0 = (
            min(u.sequences(s.budget, shape) for u, s in zip(unq, self.shares, strict=True))
            if all(u is not None for u in unq)
            else None
        )
        return Capacity(
            self.budget, tokens, n, n0, self.share.cost.setting, len(self.shares),
            self.longest_prompt(context or LONGEST_PROBE),
        )  # fmt: skip

    def longest_prompt(self, limit: int, reserve: int = 1) -> int:
        """The longest prompt (with `reserve` tokens to decode) one sequence can
        hold alone on every rank, at most `limit`: what the capacity line says
        and a refused request is told."""

        def fits(n: int) -> bool:
            shape = Shape(n, n + reserve)
            return all(s.cost.bound([shape]) <= s.budget for s in self.shares)

        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo


# -- the default budget ---------------------------------------------------------
@dataclass(frozen=True)
class MachineMemory:
    """What the default budget is derived from."""

    metal_working_set: int | None  # recommended working set (Metal), None on CPU
    ram: int | None  # physical memory


def machine_memory() -> MachineMemory:
    import mlx.core as mx

    working_set = None
    try:
        if mx.metal.is_available():
            info = mx.device_info()
            working_set = int(info.get("max_recommended_working_set_size") or 0) or None
    except (AttributeError, RuntimeError):
        working_set = None
    ram = None
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        ram = None
    return MachineMemory(working_set, ram)


def default_budget(weights: int, memory: MachineMemory) -> tuple[int, str]:
    """The default `--kv-cache-memory` and how it was derived (in words).

    Metal: 90% of the recommended working set (the wired-memory limit mlx-lm
    sets) less the weights; CPU: half the RAM less the weights. The rest is
    the margin for activations, a step's transient copies and the process.
    """
    if memory.metal_working_set:
        base, share, what = memory.metal_working_set, METAL_SHARE, "the recommended working set"
    elif memory.ram:
        base, share, what = memory.ram, CPU_RAM_SHARE, "RAM"
    else:
        raise ValueError("cannot tell this machine's memory: pass --kv-cache-memory")
    size = int(base * share) - weights
    how = f"{share:.0%} of {what} ({format_bytes(base)}) less the weights ({format_bytes(weights)})"
    return max(0, size), how


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters."""
    from mlx.utils import tree_flatten

    return int(sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def capacity_tokens(max_context: int | None) -> int:
    """The sequence length the capacity line counts in: 8,192 tokens, or the
    model's context when shorter."""
    return min(max_context or CAPACITY_TOKENS, CAPACITY_TOKENS)


def share_for(
    plan: KVPlan,
    budget: int,
    *,
    prefill_step: int,
    prompt_rows: int,
    paged: frozenset = frozenset(),
    block_size: int = 0,
) -> Share:
    """This process's share: `budget` bytes, priced from `plan` (and unquantized,
    for the capacity line's comparison); `paged`, `block_size`: the slots the
    paged layout holds in block pools."""
    cost = CostModel.from_plan(
        plan, prefill_step=prefill_step, prompt_rows=prompt_rows, paged=paged,
        block_size=block_size,
    )  # fmt: skip
    return Share(int(budget), cost, cost.unquantized())


__all__ = [
    "Capacity",
    "CostModel",
    "Ledger",
    "MachineMemory",
    "Shape",
    "Share",
    "SlotCost",
    "Verdict",
    "capacity_tokens",
    "default_budget",
    "format_bytes",
    "machine_memory",
    "setting_label",
    "share_for",
    "weights_bytes",
]
