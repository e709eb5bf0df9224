"""What the server does with every request field: the one list.

Each field of OpenAI's chat and completions requests, and each field
mlx_lm.server 0.32.2 reads, is here with its treatment:

- `HONOURED`: it does what OpenAI or mlx_lm.server documents (values the
  server cannot honour, named in the note, are a 400 naming the field);
- `APPROXIMATE`: honoured as closely as this server can, the note says how
  (the Anthropic and Responses APIs only);
- `REFUSED`: any value but the default is a 400 naming the field;
- `IGNORED`: accepted, and on this documented list because it cannot change
  the output (bookkeeping for a hosted service: `user`, `metadata`, ...).

Any field not listed is a 400 naming it. `schemas.py` declares the same
fields (a test checks that the two agree, and that `docs/server.md` lists
them); `/openapi.json` carries each field's note as its description.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Treatment(str, Enum):
    HONOURED = "honoured"
    APPROXIMATE = "honoured approximately"
    REFUSED = "400"
    IGNORED = "cannot change the output"


@dataclass(frozen=True)
class FieldDoc:
    treatment: Treatment
    note: str


H, R, IG = Treatment.HONOURED, Treatment.REFUSED, Treatment.IGNORED

COMMON = {
    "model": FieldDoc(H, "the served id or 'default_model'; any other name is a 404"),
    "max_tokens": FieldDoc(H, "default --max-tokens; clamped to the context left"),
    "max_completion_tokens": FieldDoc(H, "takes precedence over max_tokens, as in mlx_lm.server"),
    "temperature": FieldDoc(H, "0 to 2 (0: greedy); default --temp"),
    "top_p": FieldDoc(H, "above 0, at most 1; default --top-p"),
    "top_k": FieldDoc(H, "mlx-lm extra; default --top-k; 0 or at least the vocabulary: off"),
    "min_p": FieldDoc(H, "mlx-lm extra; 0 to 1; default --min-p"),
    "seed": FieldDoc(H, "own random key chain, the request stays in the batch; -1: unseeded"),
    "stop": FieldDoc(H, "a string or up to 16, matched on the decoded text, left out"),
    "stream": FieldDoc(H, "server-sent events; ': keepalive' comments while the prompt is read"),
    "stream_options": FieldDoc(
        H, "include_usage: a last chunk with usage; include_obfuscation accepted (no padding)"
    ),
    "n": FieldDoc(H, "1 only; other values 400"),
    "top_logprobs": FieldDoc(
        H,
        "0 to 20 alternatives per token; above 0 returns logprobs even without logprobs: "
        "true (mlx_lm.server's reading); -1: none",
    ),
    "repetition_penalty": FieldDoc(
        H,
        "mlx-lm extra: sign-aware multiplicative penalty on the last "
        "repetition_context_size tokens, prompt included; 0: off",
    ),
    "repetition_context_size": FieldDoc(H, "mlx-lm extra; default 20 (0: the whole context)"),
    "presence_penalty": FieldDoc(
        H, "subtracted once from each token in the last presence_context_size tokens"
    ),
    "presence_context_size": FieldDoc(H, "mlx-lm extra; default 20 (0: the whole context)"),
    "frequency_penalty": FieldDoc(
        H, "subtracted per occurrence in the last frequency_context_size tokens"
    ),
    "frequency_context_size": FieldDoc(H, "mlx-lm extra; default 20 (0: the whole context)"),
    "logit_bias": FieldDoc(
        H, "{token id: bias} added to the logits; ids outside the vocabulary 400"
    ),
    "xtc_probability": FieldDoc(H, "mlx-lm extra: XTC sampling (with temperature above 0)"),
    "xtc_threshold": FieldDoc(H, "mlx-lm extra: 0 to 0.5 (default 0.1)"),
    "user": FieldDoc(IG, "an end-user id for a hosted service"),
    "adapters": FieldDoc(H, "mlx-lm extra: the loaded --adapter-path; any other adapter 400"),
    "draft_model": FieldDoc(
        H, "mlx-lm extra: the loaded --draft-model or default_model; null: no drafting; others 400"
    ),
    "num_draft_tokens": FieldDoc(H, "mlx-lm extra: tokens drafted per step; 0: no drafting"),
}

CHAT = {
    **COMMON,
    "messages": FieldDoc(
        H,
        "roles system, developer, user, assistant, tool; text parts; other keys (tool_calls, "
        "tool_call_id, name, reasoning) reach the template, tool_calls arguments decoded from "
        "JSON as mlx_lm.server does",
    ),
    "logprobs": FieldDoc(H, "the sampled token's logprob and bytes, streamed too"),
    "tools": FieldDoc(
        H,
        "rendered by the chat template; calls parsed by mlx-lm's parser for the model into "
        "tool_calls, finish_reason tool_calls; 400 when the template does not render tools or "
        "mlx-lm has no parser for the model",
    ),
    "tool_choice": FieldDoc(
        H, "auto; none (tools not rendered, calls not parsed); required or a named function 400"
    ),
    "parallel_tool_calls": FieldDoc(H, "true (the default); false 400 (cannot be enforced)"),
    "response_format": FieldDoc(
        H,
        "text; json_object and json_schema enforced with llguidance (400 when the answer "
        "starts inside the model's reasoning)",
    ),
    "chat_template_kwargs": FieldDoc(
        H,
        "over --chat-template-args (e.g. enable_thinking); plain JSON values only; keys that "
        "change what rendering returns, chat_template, sandbox globals (range, namespace, ...) "
        "and names that are not identifiers 400",
    ),
    "role_mapping": FieldDoc(H, "mlx-lm extra, for models without a chat template; 400 with one"),
    "reasoning_effort": FieldDoc(
        H, "passed to the chat template when it reads reasoning_effort (gpt-oss's does); else 400"
    ),
    "verbosity": FieldDoc(H, "passed to the chat template when it reads verbosity; else 400"),
    "metadata": FieldDoc(IG, "tags for a hosted service's logs"),
    "store": FieldDoc(IG, "storage on a hosted service; nothing is stored"),
    "service_tier": FieldDoc(IG, "a hosted service's processing tier"),
    "prompt_cache_key": FieldDoc(
        IG, "a hosted cache's routing hint; the prompt cache is automatic"
    ),
    "prompt_cache_options": FieldDoc(IG, "a hosted cache's options; the prompt cache is automatic"),
    "prompt_cache_retention": FieldDoc(IG, "a hosted cache's retention"),
    "safety_identifier": FieldDoc(IG, "an end-user id for a hosted service's abuse checks"),
    "prediction": FieldDoc(IG, "predicted output: a latency hint, the output is the same"),
    "audio": FieldDoc(R, "audio output is not supported"),
    "modalities": FieldDoc(R, "['text'] accepted; any other 400"),
    "web_search_options": FieldDoc(R, "web search is not supported"),
    "moderation": FieldDoc(R, "moderation is not supported"),
    "functions": FieldDoc(R, "deprecated by OpenAI: use tools"),
    "function_call": FieldDoc(R, "deprecated by OpenAI: use tool_choice"),
}

COMPLETIONS = {
    **COMMON,
    "prompt": FieldDoc(H, "a string, a one-string list or token ids; several prompts 400"),
    "logprobs": FieldDoc(
        H, "an integer N (N alternatives per token, OpenAI's legacy shape) or true (mlx-lm)"
    ),
    "echo": FieldDoc(R, "false accepted; true 400"),
    "best_of": FieldDoc(R, "1 accepted; other values 400"),
    "suffix": FieldDoc(R, "fill-in-the-middle is not supported; empty accepted"),
}

FIELDS = {"chat": CHAT, "completions": COMPLETIONS}
