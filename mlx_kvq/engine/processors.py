"""Per-request logits processors: mlx-lm's penalties and `logit_bias`, and grammars.

mlx-lm's `make_logits_processors` builds the repetition, presence and
frequency penalties (each over its last `*_context_size` tokens, prompt
included) and `logit_bias`, with mlx_lm.server's defaults. `Grammars`
adds a `response_format` constraint through llguidance: each step it masks
the tokens the grammar does not allow next. `BatchGenerator.insert` takes a
list of processors per sequence and runs them on that sequence's row of the
logits only, so all of this is per request inside the continuous batch.

Every processor runs inside `GuardedProcessor`: one that raises leaves its
row unchanged for the step and records the error, and the engine fails
that request alone (one request must never fail the others), as `sampling.Guarded` does for samplers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.sample_utils import make_logits_processors

from mlx_kvq.mlx_lm_internals import hf_tokenizer

from .requests import SamplingParams

log = logging.getLogger("mlx_kvq.engine")

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class GuardedProcessor:
    """A logits processor whose failure is recorded instead of raised."""

    def __init__(self, processor: LogitsProcessor):
        self.processor = processor
        self.error: Exception | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.error is not None:
            return logits
        try:
            return self.processor(tokens, logits)
        except Exception as e:  # noqa: BLE001 - the engine fails this processor's request
            self.error = e
            return logits


def make_processors(p: SamplingParams, grammars: Grammars | None = None) -> list[GuardedProcessor]:
    """The guarded processors of one request, in mlx-lm's order (`logit_bias`,
    repetition, presence, frequency), then its grammar; [] when it has none."""
    processors = make_logits_processors(
        dict(p.logit_bias) or None,
        p.repetition_penalty,
        p.repetition_context_size,
        p.presence_penalty,
        p.presence_context_size,
        p.frequency_penalty,
        p.frequency_context_size,
    )
    if p.grammar is not None:
        if grammars is None:
            raise ValueError("this engine has no grammar support")
        processors.append(grammars.processor(p.grammar))
    return [GuardedProcessor(f) for f in processors]


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar of JSON text matching `schema` (None: any JSON object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        schema if schema is not None else {"type": "object"}
    )


def _ll_tokenizer(hf: Any, eos: list[int]) -> Any:
    """llguidance's tokenizer from the fast tokenizer's JSON. `from_tokenizer`
    copies the tokenizer first to drop padding and truncation (seconds on a
    large vocabulary, at every start): done only where either is set."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.padding is not None or backend.truncation is not None:
        return llguidance.hf.from_tokenizer(hf, eos_token=eos)
    return llguidance.LLTokenizer(backend.to_str(), eos_token=eos)


class GrammarError(ValueError):
    """The output cannot continue under the request's grammar."""


class Grammars:
    """llguidance over the served tokenizer, built (and a grammar compiled)
    once per engine, on a thread of its own, when a request first needs it
    (`response_format`, generic tool calls): reading the vocabulary holds the
    GIL for seconds (2.2 s for Gemma 3's 262,144 entries), which would stall
    the warm-up, or every request, if it ran at startup; the first request
    with a grammar waits for it instead, and every use waits too.

    `reason` says why grammars are unavailable (a tokenizer llguidance
    cannot read), or is None.
    """

    def __init__(self, tokenizer: Any):
        self.reason: str | None = None
        self._tokenizer = None
        self._loading = threading.Thread(
            target=self._load, args=(tokenizer,), name="kvq-grammars", daemon=True
        )
        self._start = threading.Lock()

    def start(self) -> None:
        """Begin reading the vocabulary (once; `wait` begins it if no one has)."""
        with self._start:
            if self._loading.ident is None:
                self._loading.start()

    def _load(self, tokenizer: Any) -> None:
        try:
            t0 = time.monotonic()
            self._tokenizer = _ll_tokenizer(hf_tokenizer(tokenizer), list(tokenizer.eos_token_ids))
            self._processor(json_grammar(None))  # the real path, once, at startup
            log.debug("llguidance read the vocabulary in %.2fs", time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - any failure means: no grammars here
            self._tokenizer = None
            self.reason = f"llguidance cannot read this tokenizer ({type(e).__name__}: {e})"
            log.warning("response_format json_object/json_schema will get 400: %s", self.reason)

    def wait(self) -> Grammars:
        """Block until llguidance has read the tokenizer (or failed to)."""
        self.start()
        self._loading.join()
        return self

    @property
    def available(self) -> bool:
        return self.wait()._tokenizer is not None

    def check(self, grammar: str) -> str | None:
        """Why `grammar` cannot be used, or None."""
        if self.wait()._tokenizer is None:
            return self.reason
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        return None if not error or error.startswith("WARNING") else error

    def processor(self, grammar: str) -> GrammarProcessor:
        return self.wait()._processor(grammar)

    def _processor(self, grammar: str) -> GrammarProcessor:
        if self._tokenizer is None:
            raise ValueError(f"grammars are unavailable: {self.reason}")
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return GrammarProcessor(matcher, self._tokenizer.vocab_size)


class GrammarProcessor:
    """Masks every token the grammar does not allow next.

    The first call sees the prompt; every later call first feeds the grammar
    the token sampled since (the last token of the context).
    """

    def __init__(self, matcher: Any, vocab: int):
        self.matcher = matcher
        self.vocab = vocab
        self.bitmask = allocate_token_bitmask(1, vocab)
        self.started = False

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.started and not self.matcher.consume_token(int(tokens[-1].item())):
            raise GrammarError(f"the output left the grammar: {self.matcher.get_error()}")
        self.started = True
        fill_next_token_bitmask(self.matcher, self.bitmask)
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        width = logits.shape[-1]
        bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[
            : min(width, self.vocab)
        ]
        allowed = np.zeros(width, dtype=bool)
        allowed[: len(bits)] = bits.astype(bool)
        return mx.where(mx.array(allowed), logits, mx.array(-float("inf"), logits.dtype))
