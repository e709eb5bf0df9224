"""What the server does with every request field: the one list, for every API.

Each field of OpenAI's chat and completions requests, each field
mlx_lm.server 0.32.2 reads, and each field of Anthropic's Messages and
OpenAI's Responses requests (what the `anthropic` and `openai` SDKs, Claude
Code and Codex send) is here with its treatment:

- `HONOURED`: it does what OpenAI or mlx_lm.server documents (values the
  server cannot honour, named in the note, are a 400 naming the field);
- `APPROXIMATE`: honoured as closely as this server can, the note says how;
- `REFUSED`: any value but the default is a 400 naming the field;
- `IGNORED`: accepted, and on this documented list because it cannot change
  the output (bookkeeping for a hosted service: `user`, `metadata`, ...).

Any field not listed is a 400 naming it. Each API's `schemas.py` declares
the same fields (tests check that they agree, and that `docs/server.md` and
`docs/agents.md` list them); `/openapi.json` carries each field's note as
its description.
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


# how the generic tool format treats a request's tools, on every API
GENERIC = (
    "with --tool-format json (the generic format, for templates that render no tools): "
    "described in a system block, the answer held by a grammar to text or one JSON call"
)
H, A, R, IG = Treatment.HONOURED, Treatment.APPROXIMATE, Treatment.REFUSED, Treatment.IGNORED

COMMON = {
    "model": FieldDoc(
        H,
        "a served model's name or alias, 'default_model', or a model directory, GGUF file or "
        "repo, loaded on demand; any other name is a 404",
    ),
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
        "mlx-lm has no parser for the model; " + GENERIC,
    ),
    "tool_choice": FieldDoc(
        H,
        "auto; none (tools not rendered, calls not parsed); required or a named function: "
        "enforced with --tool-format json (only the call is allowed), else 400",
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

# Anthropic's Messages (/v1/messages; count_tokens takes the fields that shape the prompt)
MESSAGES = {
    "model": FieldDoc(
        H,
        "a served model's name or alias, or a model directory or GGUF file (loaded on "
        "demand); any other name is answered by the default model (as llama-server does "
        "with one model); with --served-model-name other names 404",
    ),
    "max_tokens": FieldDoc(
        H, "beyond the context the answer ends where the context does (stop_reason max_tokens)"
    ),
    "messages": FieldDoc(
        H,
        "roles user, assistant and system (system turns after the first folded into the user "
        "turn next to them for templates that do not render them; a system turn's "
        "output_config, as Claude Code sends it, read as the request's output_config); blocks "
        "text, tool_use, tool_result (string or text blocks), thinking and redacted_thinking "
        "sent back; image and document 400 (no model served here takes them); a final "
        "assistant turn (prefill) 400",
    ),
    "system": FieldDoc(
        H,
        "a string or text blocks, the first system turn; Claude Code's "
        "x-anthropic-billing-header block is dropped before rendering",
    ),
    "tools": FieldDoc(
        H,
        "rendered by the chat template as functions (input_schema as parameters); calls "
        "parsed into tool_use blocks; defer_loading: approximately, deferred tools are "
        "rendered with the others (there is no tool search here); " + GENERIC,
    ),
    "tool_choice": FieldDoc(
        H,
        "auto; none (tools not rendered, calls not parsed); any and tool: enforced with "
        "--tool-format json (only a call, to that tool, is allowed), else 400; "
        "disable_parallel_tool_use: true 400",
    ),
    "stop_sequences": FieldDoc(
        H, "up to 16, matched on the decoded text, left out; stop_reason stop_sequence"
    ),
    "stream": FieldDoc(H, "Anthropic's server-sent events; ping while the prompt is read"),
    "temperature": FieldDoc(H, "0 to 1 (0: greedy); default --temp"),
    "top_p": FieldDoc(H, "above 0, at most 1; default --top-p"),
    "top_k": FieldDoc(H, "default --top-k; 0: off"),
    "thinking": FieldDoc(
        A,
        "enabled and adaptive: the model reasons as its template lets it; disabled: "
        "enable_thinking false for templates that read it; the model's reasoning comes back "
        "as thinking blocks either way; budget_tokens is not a separate cut (max_tokens "
        "bounds reasoning and answer together); display omitted: thinking blocks carry no text",
    ),
    "output_config": FieldDoc(
        A,
        "effort: passed as reasoning_effort to templates that read it (gpt-oss's), else no "
        "effect; also read from a system turn of messages (the request's own comes first); "
        "format (structured output) 400",
    ),
    "context_management": FieldDoc(
        IG,
        "server-side edits of the history (clear_thinking, clear_tool_uses): the history is "
        "rendered as sent, and the chat template decides which earlier reasoning it keeps",
    ),
    "cache_control": FieldDoc(IG, "cache hints; the prompt cache is automatic"),
    "metadata": FieldDoc(IG, "user_id for a hosted service's abuse checks"),
    "service_tier": FieldDoc(IG, "a hosted service's processing tier"),
    "inference_geo": FieldDoc(IG, "where a hosted service runs the request"),
    "speed": FieldDoc(IG, "a hosted service's speed tier"),
    "diagnostics": FieldDoc(IG, "a hosted service's diagnostics"),
    "container": FieldDoc(R, "code-execution containers are not supported"),
    "mcp_servers": FieldDoc(R, "MCP servers run by a hosted service are not supported"),
}

# OpenAI's Responses (/v1/responses)
RESPONSES = {
    "model": FieldDoc(
        H,
        "as for Messages: a served model's name or alias, or a directory or GGUF file; any "
        "other name is answered by the default model; with --served-model-name, 404",
    ),
    "input": FieldDoc(
        H,
        "a string or items: message (roles user, assistant, system, developer; text parts; "
        "images and files 400), function_call, function_call_output, reasoning (its "
        "encrypted_content from this server, or its summary, becomes the turn's reasoning)",
    ),
    "instructions": FieldDoc(H, "the first system turn (not carried to later responses)"),
    "max_output_tokens": FieldDoc(
        H, "default --max-tokens; beyond the context the answer ends there (incomplete)"
    ),
    "temperature": FieldDoc(H, "0 to 2 (0: greedy); default --temp"),
    "top_p": FieldDoc(H, "above 0, at most 1; default --top-p"),
    "stream": FieldDoc(H, "the Responses API's events, each with its sequence_number"),
    "store": FieldDoc(
        H, "true: kept for previous_response_id and GET (bounded, --response-store-bytes)"
    ),
    "previous_response_id": FieldDoc(H, "continues a stored response's conversation; unknown 404"),
    "include": FieldDoc(
        H, "reasoning.encrypted_content: an opaque value this server reads back; others 400"
    ),
    "tools": FieldDoc(
        A,
        "function tools rendered by the chat template and their calls parsed; namespace tools "
        "rendered as their member functions; strict is not enforced (calls are the model's, "
        "parsed); hosted tools (web_search, file_search, ...) left out of the prompt, logged "
        "once and counted in /metrics; " + GENERIC + " (the arguments match the parameters)",
    ),
    "tool_choice": FieldDoc(
        H,
        "auto; none (tools not rendered); required or a named function: enforced with "
        "--tool-format json, else 400",
    ),
    "parallel_tool_calls": FieldDoc(H, "true (the default); false 400 (cannot be enforced)"),
    "reasoning": FieldDoc(
        A,
        "effort passed as reasoning_effort to templates that read it, else no effect; "
        "summary: the reasoning is returned whole as the summary text",
    ),
    "text": FieldDoc(
        A,
        "format text, json_object or json_schema (enforced with llguidance); verbosity passed "
        "to templates that read it, else no effect",
    ),
    "prompt_cache_key": FieldDoc(
        IG, "a hosted cache's routing hint; the prompt cache is automatic"
    ),
    "prompt_cache_retention": FieldDoc(IG, "a hosted cache's retention"),
    "metadata": FieldDoc(IG, "tags for a hosted service's logs (echoed back)"),
    "client_metadata": FieldDoc(IG, "Codex's client tags for a hosted service"),
    "user": FieldDoc(IG, "an end-user id for a hosted service"),
    "safety_identifier": FieldDoc(IG, "an end-user id for a hosted service's abuse checks"),
    "service_tier": FieldDoc(IG, "a hosted service's processing tier"),
    "truncation": FieldDoc(IG, "the history is never truncated; a prompt over the context 400"),
    "stream_options": FieldDoc(IG, "include_obfuscation: nothing is obfuscated"),
    "background": FieldDoc(R, "true 400: background responses are not supported"),
    "conversation": FieldDoc(R, "hosted conversation objects are not supported"),
    "prompt": FieldDoc(R, "hosted prompt templates are not supported"),
}

FIELDS = {"chat": CHAT, "completions": COMPLETIONS, "messages": MESSAGES, "responses": RESPONSES}
