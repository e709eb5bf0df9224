"""How one request samples: `SamplingParams`, the one record of it.

A setting like `KVConfig` (frozen, validated, no MLX): the server's flags,
each API's request body and the engine's samplers all read this class, so
it sits below them all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_MAX_TOKENS = 512  # mlx_lm.server's --max-tokens


class SamplingError(ValueError):
    """A sampling value that cannot be used; `field` names the `SamplingParams` field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples: the one record from the server's flags and
    each API's request body to the sampler. `temperature == 0` is greedy.

    Every default is held here: the server's flags default to these values
    (`commands/flags.py`), the server's own defaults are one instance of this
    class built from the flags, and each API's translator builds a request's
    params from that instance with `updated` (vLLM's `to_sampling_params`).
    The penalties, `logit_bias` and XTC have mlx-lm's meanings and defaults
    (`mlx_lm.sample_utils.make_logits_processors` / `make_sampler`, the values
    `mlx_lm.server` uses when a request leaves them out); a penalty of 0 is
    off. `grammar` is an llguidance grammar (JSON text) that the output must
    match (`response_format`), or None. A value no sampler can use raises
    `SamplingError` naming the field.
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple[tuple[int, float], ...] = ()
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    grammar: str | None = None

    def __post_init__(self) -> None:  # lists from JSON (other ranks) become tuples
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(
            self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias)
        )
        for name, ok, rule in (
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be >= 0"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("top_logprobs", self.top_logprobs >= 0, "must be >= 0"),
        ):
            if not ok:
                raise SamplingError(name, f"{rule}, not {getattr(self, name)}")

    def updated(self, **values: object) -> SamplingParams:
        """These params with the given fields replaced; a None value keeps the field."""
        given = {k: v for k, v in values.items() if v is not None}
        return replace(self, **given) if given else self

    def check_vocabulary(self, vocab: int) -> None:
        """Refuse `logit_bias` token ids outside the model's `vocab` logits
        (mlx-lm would index out of bounds)."""
        for token, _ in self.logit_bias:
            if not 0 <= token < vocab:
                raise SamplingError(
                    "logit_bias", f"token id {token} is outside the vocabulary (0..{vocab - 1})"
                )
