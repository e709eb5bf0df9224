"""What a benchmark run measures: presets and the model configurations."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Gemma-3-like hybrid decoders (5 sliding-window layers per full-attention
# layer, grouped-query heads of dimension 128), random weights, no download.
MODELS: dict[str, dict] = {
    # about 1M parameters: for --quick and tests
    "tiny": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=512,
        sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=64,
        max_position_embeddings=4096,
    ),
    # about 21M parameters: the default; long-context decode is attention-bound
    "small": dict(
        model_type="gemma3_text", hidden_size=256, num_hidden_layers=12, intermediate_size=1024,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=16384,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=128,
        max_position_embeddings=65536,
    ),
    # about 90M parameters
    "medium": dict(
        model_type="gemma3_text", hidden_size=512, num_hidden_layers=18, intermediate_size=2048,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=32768,
        sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=128,
        max_position_embeddings=131072,
    ),
    # Gemma 3 1B's shapes (about 1B parameters, 262k vocabulary)
    "large": dict(
        model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256,
        max_position_embeddings=131072,
    ),
}  # fmt: skip

SECTIONS = ("attention", "model", "memory", "serving", "budget", "servers", "agents")
# what a run measures unless --sections says otherwise: the servers and agents
# sections need a real model (--model) and start processes
DEFAULT_SECTIONS = ("attention", "model", "memory", "serving", "budget")


@dataclass
class BenchSettings:
    sections: tuple[str, ...] = DEFAULT_SECTIONS
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32")
    bits: tuple[int, ...] = (8, 4)  # quantized settings compared with unquantized
    kv_settings: tuple = ()  # KVConfigs also measured in the model section (--setting)
    group_size: int = 64
    seed: int = 0
    # attention alone
    attn_contexts: tuple[int, ...] = (1024, 4096, 16384, 32768)
    attn_queries: tuple[int, ...] = (1, 128)
    attn_heads: tuple[int, int] = (16, 4)  # query heads, KV heads
    attn_head_dim: int = 128
    attn_bits: int = 4
    attn_repeats: int = 5
    attn_budget_s: float = 10.0  # per candidate and cell: fewer repeats beyond it
    mlx_lm_max_call_s: float = 30.0  # skip mlx-lm cells predicted to take longer per call
    # the model
    model: str = "small"
    model_config: dict = field(default_factory=dict)
    contexts: tuple[int, ...] = (1024, 4096, 16384)
    decode_tokens: int = 2  # decode steps per sample
    decode_repeats: int = 9
    prefill_chunk: int = 128
    prefill_repeats: int = 4
    # one labelled row measured with MLX's linked (reference) BLAS in both arms,
    # to show what the fast BLAS changes (mlx_kvq.blas.use_linked_blas)
    reference_blas_dtype: str = "float32"
    reference_blas_contexts: tuple[int, ...] = (4096,)
    # memory
    memory_context: int = 16384
    memory_dtype: str = "bfloat16"  # also the serving section's model dtype
    memory_decode_tokens: int = 8
    # serving
    streams: tuple[int, ...] = (1, 4, 16)
    serving_bits: tuple[int, ...] = (4,)
    serving_prompt: int = 64
    serving_tokens: int = 32
    serving_repeats: int = 3
    # serving under a KV memory budget (budget_bench.py)
    budget_memory: int | None = None  # bytes; None: what budget_unquantized sequences need
    budget_unquantized: int = 4
    budget_requests: int = 16
    budget_prompt: int = 128
    budget_tokens: int = 128
    budget_repeats: int = 2
    # mlx-kvq serve against mlx_lm.server over HTTP on one model (servers_bench.py)
    server_model: str | None = None  # an mlx-lm model directory
    server_arms: tuple[str, ...] = ("", "--kv-bits 0")  # serve flags per arm ("": defaults)
    server_streams: tuple[int, ...] = (1, 16)
    server_prompt: int = 80  # prompt tokens per request
    server_tokens: int = 96  # answer tokens per request (fewer where the model stops)
    server_mixed: tuple[int, int, int] = (4096, 256, 15)  # one long prompt beside shorts
    server_long: int = 15000  # time to first token on a prompt this long (0: not measured)
    server_rounds: int = 2
    server_starts: int = 2  # timed starts per server, each alone, alternating
    server_text: str | None = None  # prompts are cut from it (default: the demo texts)
    # coding-agent sessions against mlx_lm.server over HTTP, on server_model (agents_bench.py)
    agent_arms: tuple[str, ...] = ("", "--kv-bits 0")  # serve flags per arm ("": defaults)
    agent_sessions: int = 4  # sessions at once
    agent_turns: int = 6  # turns per session
    agent_system: int = 2100  # tokens of the shared system prompt (at most)
    agent_tool_chars: int = 2400  # characters of Python source per tool result (about)
    agent_tokens: int = 40  # answer tokens per turn (at most)
    agent_rewrite: int = 4  # the turn that clears each session's first tool result (0: none)
    agent_api: str = "auto"  # auto (chat if the model has a chat template), chat, completions
    agent_sources: str | None = None  # a folder of .py files (default: the standard library)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_config"] = self.resolved_model_config()
        return d

    def resolved_model_config(self) -> dict:
        return dict(self.model_config) if self.model_config else dict(MODELS[self.model])


def quick() -> BenchSettings:
    """A tiny setting (seconds): every section, every code path, for tests."""
    return BenchSettings(
        dtypes=("float16", "float32"),
        attn_contexts=(64, 256),
        attn_queries=(1, 8),
        attn_heads=(4, 2),
        attn_head_dim=64,
        attn_repeats=2,
        attn_budget_s=2.0,
        mlx_lm_max_call_s=5.0,
        model="tiny",
        contexts=(48, 160),
        decode_tokens=2,
        decode_repeats=2,
        prefill_chunk=16,
        prefill_repeats=2,
        reference_blas_contexts=(48,),
        memory_context=160,
        memory_decode_tokens=2,
        streams=(1, 2),
        serving_prompt=8,
        serving_tokens=4,
        serving_repeats=1,
        budget_requests=6,
        budget_unquantized=1,
        budget_prompt=600,  # past what the split layout keeps exact
        budget_tokens=4,
        budget_repeats=1,
    )
