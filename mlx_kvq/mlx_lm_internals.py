"""The private parts of mlx-lm that mlx-kvq relies on, in one place.

Each was checked against mlx-lm 0.32.2; when mlx-lm changes one of them,
this is the only file to change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models.cache import _BaseCache
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    SPMStreamingDetokenizer,
    TokenizerWrapper,
    _byte_decoder,
)
from mlx_lm.utils import _download, _get_classes

# mlx-lm 0.32.2: the base class of every cache (state, meta_state, trimming and
# `from_state` for prompt-cache files); our caches derive from it.
BaseCache = _BaseCache


def batch_caches(generator: BatchGenerator) -> list[Any]:
    """The per-layer caches of every sequence a `BatchGenerator` holds.

    mlx-lm 0.32.2 keeps them in `_prompt_batch` (prompts being processed) and
    `_generation_batch` (sequences decoding) and has no public accessor.
    """
    return list(generator._prompt_batch.prompt_cache) + list(
        generator._generation_batch.prompt_cache
    )


def decoding_caches(generator: BatchGenerator) -> list[Any]:
    """The per-layer caches of the sequences a `BatchGenerator` is decoding
    (mlx-lm 0.32.2: `_generation_batch`), without the prompts it processes."""
    return list(generator._generation_batch.prompt_cache)


def prompt_chunks(generator: BatchGenerator) -> list[int]:
    """Tokens each prompt would take in the batch's next step if its chunk
    had no limit: the rest of its current segment, for the prompts being
    processed and for the queued ones that join them in that step.

    mlx-lm 0.32.2's `_next` takes `min(len(segment), prefill_step_size)`
    tokens of every prompt (`_currently_processing[i][0]` and, for the
    queued, `_unprocessed_sequences[j][1]`, are their segments), right-pads
    them to the longest and runs the model on all; a prompt whose only
    segment is its last token moves to decoding instead.
    """
    joining = min(
        generator.prefill_batch_size - len(generator._prompt_batch),
        generator.completion_batch_size - len(generator._generation_batch),
        len(generator._unprocessed_sequences),
    )
    segments = [p[0] for p in generator._currently_processing]
    segments += [generator._unprocessed_sequences[j][1] for j in range(max(0, joining))]
    return [len(s[0]) for s in segments if not (len(s) == 1 and len(s[0]) == 1)]


def cut_segment(generator: BatchGenerator, uid: int, left: int) -> tuple[int, bool] | None:
    """End a segment of prompt `uid`'s tokens still to process where `left`
    of them remain after it, so that its caches come back there (a
    response's `end_of_segment`). Returns how many segment ends come before
    that point and whether the cut was made now (False: a segment ends there
    already); None when the point is processed already.

    mlx-lm 0.32.2 keeps the segments still to process of row `i` of the
    prompt batch in `_currently_processing[i][0]` (its uid
    `_prompt_batch.uids[i]`) and those of a queued prompt in
    `_unprocessed_sequences[j][1]` (its uid `[j][0]`); `_next` takes each
    step's chunk from the first segment and ends a segment when it is used up.
    """
    segments = None
    for i, u in enumerate(generator._prompt_batch.uids):
        if u == uid:
            segments = generator._currently_processing[i][0]
    for entry in generator._unprocessed_sequences:
        if entry[0] == uid:
            segments = entry[1]
    if segments is None:
        return None
    at = sum(len(s) for s in segments) - left  # from the first token still to process
    for j, segment in enumerate(segments):
        if at <= 0:
            return None
        if at < len(segment):
            segments[j : j + 1] = [segment[:at], segment[at:]]
            return j, True
        if at == len(segment):
            return j, False
        at -= len(segment)
    return None


@contextmanager
def chunk_limit(generator: BatchGenerator, tokens: int) -> Iterator[None]:
    """Within the block, a prompt takes at most `tokens` per step (mlx-lm
    0.32.2 reads `prefill_step_size` in `_next`; the prompt batch splits its
    model calls by its own copy, which stays)."""
    step = generator.prefill_step_size
    generator.prefill_step_size = tokens
    try:
        yield
    finally:
        generator.prefill_step_size = step


class _DecodingBatch(GenerationBatch):
    """mlx-lm 0.32.2's `GenerationBatch` with two changes to its step.

    - No step ahead when every row ends with this step's token by its token
      limit. `next` returns the tokens sampled last step after `_step` has
      run the model on them (their K/V into the cache) and sampled the next
      ones: a forward no row uses when all of them end now, and one the next
      request waits behind (about 0.1 s on Gemma 3 270M). That last step
      returns the tokens alone; the rows' caches and `tokens` then end before
      the last token, which the prompt cache keeps them as.
    - The logits are normalized by `log_softmax` (a faster one where there
      is: MLX's CPU exp is scalar, and a step normalizes rows x vocabulary).

    Otherwise `_step` does what mlx-lm's does: the model on the tokens
    sampled last step, each row's logits processors, one sampler call when
    the rows share one, the next tokens started asynchronously, then the
    current ones evaluated and appended to `tokens`."""

    _last = False
    log_softmax: Callable[[mx.array], mx.array]  # set by `decode_with`

    def next(self):
        self._last = bool(self.uids) and all(
            n + 1 >= m for n, m in zip(self._num_tokens, self.max_tokens, strict=True)
        )
        return super().next()

    def _step(self) -> tuple[list[int], list[mx.array]]:
        current, current_logprobs = self._next_tokens, self._next_logprobs
        self._current_tokens, self._current_logprobs = current, current_logprobs
        if self._last:
            self._last = False
            mx.eval(current, current_logprobs)
            return current.tolist(), current_logprobs
        logits = self.model(current[:, None], cache=self.prompt_cache)[:, -1, :]
        contexts = []
        if any(self.logits_processors):
            rows = []
            for e, processors in enumerate(self.logits_processors):
                row = logits[e : e + 1]
                if processors:
                    context = self._token_context[e].update_and_fetch(current[e : e + 1])
                    contexts.append(context)
                    for processor in processors:
                        row = processor(context, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        logprobs = self.log_softmax(logits)
        given = self.samplers or [None] * len(self.uids)
        samplers = [self.fallback_sampler if s is None else s for s in given]
        if all(s is samplers[0] for s in samplers):
            sampled = samplers[0](logprobs)
        else:
            sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)])
        self._next_tokens, self._next_logprobs = sampled, list(logprobs)
        mx.async_eval(self._next_tokens, self._next_logprobs, contexts)
        mx.eval(current, current_logprobs)
        tokens = current.tolist()
        for held, token in zip(self.tokens, tokens, strict=True):
            held.append(token)
        return tokens, current_logprobs


def decode_with(generator: BatchGenerator, log_softmax: Callable[[mx.array], mx.array]) -> None:
    """Make `generator`'s decoding batch a `_DecodingBatch` normalizing with
    `log_softmax`. mlx-lm 0.32.2 keeps one `GenerationBatch` for the
    generator's life (`_generation_batch`, grown by `extend`); only this
    generator's changes."""
    batch = generator._generation_batch
    batch.__class__ = _DecodingBatch
    batch.log_softmax = log_softmax


def pending_token(generator: BatchGenerator, uid: int) -> tuple[int, mx.array] | None:
    """The token the batch has already sampled for `uid`'s next step, with its
    log-probabilities (None when `uid` is not decoding).

    mlx-lm 0.32.2's `GenerationBatch` samples one step ahead (`_next_tokens`,
    `_next_logprobs`): the sampler has drawn it, the cache does not hold it
    yet. A sequence taken out of the batch and resumed later emits it and
    feeds it as its last prompt token, so its sampler's key chain and its
    logits processors go on exactly where they stopped.
    """
    batch = generator._generation_batch
    if uid not in batch.uids or batch._next_tokens is None:
        return None
    i = batch.uids.index(uid)
    token = batch._next_tokens[i]
    logprobs = batch._next_logprobs[i]
    mx.eval(token, logprobs)
    return int(token.item()), logprobs


def model_classes(config: dict[str, Any]) -> tuple[type, type]:
    """(Model class, ModelArgs class) for a config, as `mlx_lm.load` picks them
    (mlx-lm 0.32.2: `mlx_lm.utils._get_classes`)."""
    return _get_classes(config)


def local_model(path_or_repo: str, allow_patterns: list[str] | None = None) -> Path:
    """The local directory of a model: the path itself, or a Hugging Face repo
    downloaded (only `allow_patterns` if given), as `sharded_load` does it
    (mlx-lm 0.32.2: `mlx_lm.utils._download`)."""
    return _download(str(path_or_repo), allow_patterns=allow_patterns)


def hf_tokenizer(wrapper: Any) -> Any:
    """The Hugging Face tokenizer inside mlx-lm's `TokenizerWrapper` (0.32.2:
    `_tokenizer`); any other tokenizer is returned as it is."""
    return wrapper._tokenizer if isinstance(wrapper, TokenizerWrapper) else wrapper


def token_bytes(detokenizer: Any, token: int) -> bytes | None:
    """The bytes `token` stands for, as mlx-lm's streaming `detokenizer` reads
    them (0.32.2: SPM's `tokenmap` of bytes with U+2581 for a space; byte-level
    BPE's `tokenmap` through `_byte_decoder`, other characters as UTF-8);
    None for any other detokenizer."""
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        return detokenizer.tokenmap[token].replace(SPMStreamingDetokenizer._sep, b" ")
    if isinstance(detokenizer, BPEStreamingDetokenizer) and token < len(detokenizer.tokenmap):
        table = _byte_decoder()
        return b"".join(
            bytes([table[c]]) if c in table else c.encode() for c in detokenizer.tokenmap[token]
        )
    return None


def ring_index(cache: Any) -> int:
    """The next slot a `RotatingKVCache` (or its batch form) writes (0.32.2: `_idx`)."""
    return cache._idx


@dataclass(frozen=True)
class BatchCursor:
    """Where a batch cache of mlx-lm 0.32.2 stands, beyond its public `offset`
    and `left_padding`: the write index (`_idx`), a window's token count
    (`_offset`), right padding between `prepare` and `finalize`
    (`_right_padding`) and a window's per-row lengths (`_lengths`)."""

    idx: int
    offset: int | None
    right_padding: mx.array | None
    lengths: mx.array | None


def batch_cursor(cache: Any) -> BatchCursor:
    """The `BatchCursor` of a `BatchKVCache` or `BatchRotatingKVCache`."""
    return BatchCursor(
        idx=cache._idx,
        offset=getattr(cache, "_offset", None),
        right_padding=getattr(cache, "_right_padding", None),
        lengths=getattr(cache, "_lengths", None),
    )
