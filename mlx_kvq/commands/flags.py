"""Every flag of every command, defined once: the shared ones first, then each
command's own (`add_serve_flags`, `add_generate_flags`, ...).

Names and meanings follow mlx-lm (`--model`, `--kv-bits`, `--kv-group-size`,
`--quantized-kv-start`, `--max-kv-size`, `--temp`, ...). A value that can be
checked without the model is checked by argparse or when the settings are
built, so a bad one exits with status 2 before anything is loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

from ..config import (
    KEY_SCALES,
    PAGED_BLOCK_SIZE,
    ROTATIONS,
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    KVConfig,
)
from ..defaults import DEFAULT_KV_CONFIG, resolve_widths
from ..engine.disk import DEFAULT_DISK_BYTES
from ..residency import DEFAULT_MODEL_ALIAS
from ..residency.pool import DEFAULT_WAIT_S
from ..sampling_params import DEFAULT_MAX_TOKENS, SamplingError, SamplingParams
from ..server.settings import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RESPONSE_STORE_BYTES, ToolFormat
from ..speculative import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '1000000', '512MB', '1.5GiB', ... (powers of 1000, or 1024 with 'i')."""
    m = _SIZE.match(str(text))
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 1000000, 512MB or 2GiB)")
    number, unit, binary = m.groups()
    base = 1024 if binary else 1000
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * base**power)


def json_object(text: str) -> dict:
    """A JSON object given on the command line."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _bits(text: str) -> int:
    bits = int(text)
    if bits != 0 and bits not in SUPPORTED_BITS:
        raise argparse.ArgumentTypeError(
            f"kv bits must be one of {SUPPORTED_BITS}, or 0 (unquantized)"
        )
    return bits


def _group_size(text: str) -> int:
    size = int(text)
    if size not in SUPPORTED_GROUP_SIZES:
        raise argparse.ArgumentTypeError(f"kv group size must be one of {SUPPORTED_GROUP_SIZES}")
    return size


def _count(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return n


def _layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of layers: {text!r}"
        ) from None


# -- flags several commands take ------------------------------------------------------
DEFAULT_PREFILL_STEP = 2048  # mlx-lm's prefill_step_size


def add_prompt_flag(parser: argparse.ArgumentParser, help: str, default: str | None = None) -> None:
    """`--prompt` / `-p`: required unless the command has a default prompt."""
    parser.add_argument("--prompt", "-p", default=default, required=default is None, help=help)


def add_prompt_cache_file_flag(
    parser: argparse.ArgumentParser, help: str, required: bool = False
) -> None:
    parser.add_argument("--prompt-cache-file", default=None, required=required, help=help)


def add_prefill_step_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill-step-size", type=int, default=DEFAULT_PREFILL_STEP,
        help=f"most prompt tokens per prefill step (default: {DEFAULT_PREFILL_STEP})",
    )  # fmt: skip


def add_pipeline_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline", action="store_true",
        help="under mlx.launch: pipeline parallel (layers split over ranks) instead of "
        "tensor parallel (heads split over ranks), as in mlx-lm",
    )  # fmt: skip


def add_seed_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seed", type=int, default=None, help="random seed")


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or repo, a GGUF file (converted once into a cache directory; "
        "llama, qwen2, qwen3, gemma3), or an embedded demo model: demo:gemma (hybrid "
        "attention, the default) or demo:full (full attention on every layer)",
    )


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """`--dtype`: what the loaded weights compute in (`mlx_kvq.compute`)."""
    from ..compute import DTYPES

    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the weights' floats; auto: float32 on MLX's CPU backend for a "
        "float16/bfloat16 model (its half-precision products skip the BLAS, about 20x "
        "slower), the model's own elsewhere",
    )


def add_adapter_flag(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's `--adapter-path`: LoRA/DoRA/full fine-tune weights applied at load."""
    parser.add_argument(
        "--adapter-path",
        default=None,
        help="directory with adapter_config.json and adapters.safetensors (as written by "
        "mlx_lm.lora), applied to the model before the KV plan and the warm-up",
    )


def add_draft_flags(parser: argparse.ArgumentParser) -> None:
    """mlx-lm's speculative decoding flags."""
    parser.add_argument(
        "--draft-model",
        default=None,
        help="a smaller model with the same tokenizer that drafts tokens for speculative "
        "decoding; its KV caches are quantized like the model's",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help=f"tokens drafted per step, with --draft-model (default: {DEFAULT_DRAFT_TOKENS})",
    )


def check_draft_tokens(args: argparse.Namespace) -> None:
    """Refuse a draft length no request could use, or one without a draft
    model (it would change nothing); fill in the default."""
    if args.num_draft_tokens is None:
        args.num_draft_tokens = DEFAULT_DRAFT_TOKENS
        return
    if not args.draft_model:
        raise ValueError("--num-draft-tokens needs --draft-model (speculative decoding)")
    if not 1 <= args.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--num-draft-tokens must be in [1, {MAX_DRAFT_TOKENS}]")


def add_kv_flags(parser: argparse.ArgumentParser) -> None:
    """The KV cache flags: mlx-lm's names, plus ours. Same meaning in every command.

    With none of `--kv-bits`, `--kv-key-bits`, `--kv-value-bits`, the default
    setting of `mlx_kvq/defaults.py` applies; 0 for any of them means
    unquantized (`--kv-bits 0`: no quantization at all; `--kv-key-bits 0
    --kv-value-bits 4`: keys in full precision, values at 4 bits;
    `--kv-window-bits 0`: bounded layers in full precision).
    """
    g = parser.add_argument_group("KV cache")
    g.add_argument(
        "--kv-bits",
        type=_bits,
        default=None,
        help="bits for keys and values (2,3,4,5,6,8; 0: unquantized); default: "
        f"mlx_kvq/defaults.py ({DEFAULT_KV_CONFIG.describe()}; windows only with a "
        "bounded layer)",
    )
    g.add_argument(
        "--kv-group-size",
        type=_group_size,
        default=64,
        help="quantization group size (default 64)",
    )
    g.add_argument(
        "--kv-key-bits",
        type=_bits,
        default=None,
        help="bits for keys (overrides --kv-bits; 0: keys unquantized)",
    )
    g.add_argument(
        "--kv-value-bits",
        type=_bits,
        default=None,
        help="bits for values (overrides --kv-bits; 0: values unquantized)",
    )
    g.add_argument(
        "--kv-rotation",
        choices=ROTATIONS,
        default=None,
        help="rotate K/V with a Hadamard transform before quantizing (default: none "
        "with explicit bits, as in mlx-lm; the default setting's without)",
    )
    g.add_argument(
        "--kv-window-bits",
        type=_bits,
        default=None,
        help="bits for keys and values of bounded layers (sliding window, chunked, "
        "--max-kv-size; 0: unquantized), per token in groups of --kv-group-size with no "
        "token exact (--kv-key-scales channel and --kv-residual then shape the other "
        "layers only); default: as the other layers (with no bits flag: the default "
        "setting's, 8)",
    )
    g.add_argument(
        "--kv-key-scales",
        choices=KEY_SCALES,
        default=None,
        help="what gets its own scale and bias in the keys: token (each token's key, in "
        "groups of channels, as mlx-lm) or channel (each channel, in groups of "
        "--kv-key-group-size tokens: KIVI, for keys with outlier channels); default: token "
        "with explicit bits, the default setting's without",
    )
    g.add_argument(
        "--kv-key-group-size",
        type=_group_size,
        default=None,
        help="group size of the keys (tokens per group with --kv-key-scales channel); "
        "default: --kv-group-size",
    )
    g.add_argument(
        "--kv-residual",
        type=_count,
        default=None,
        help="the last N tokens of every layer (bounded ones too, unless --kv-window-bits "
        "is given) stay unquantized (in 16 bits), quantized as newer ones arrive; default: "
        "0 with explicit bits, the default setting's without",
    )
    g.add_argument(
        "--kv-sinks",
        type=_count,
        default=None,
        help="the first N tokens of full-attention layers stay unquantized (attention "
        "sinks); default: 0 with explicit bits, the default setting's without",
    )
    g.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        help="tokens held in full precision before quantization starts "
        "(mlx-lm's default is 5000; ours 0)",
    )
    g.add_argument(
        "--max-kv-size",
        type=int,
        default=None,
        help="bound every full-attention layer to this many recent tokens",
    )
    g.add_argument(
        "--allow-partial-kv",
        action="store_true",
        help="allow --kv-skip-layers to leave layers unquantized (reported loudly)",
    )
    g.add_argument("--kv-skip-layers", type=_layers, default=None,
                   help="comma-separated cache slots to leave unquantized")  # fmt: skip


def kv_config(args: argparse.Namespace, bounded: bool = True) -> KVConfig:
    """The KV setting the KV flags ask for (raises ValueError for a bad one);
    with no bits flag, the default of a model that has (`bounded`) or has not
    a bounded layer: `startup.kv_setting` asks the model."""
    w = resolve_widths(
        args.kv_bits, args.kv_key_bits, args.kv_value_bits, args.kv_rotation,
        args.kv_window_bits, bounded, args.kv_key_scales, args.kv_key_group_size,
        args.kv_residual, args.kv_sinks,
    )  # fmt: skip
    return KVConfig.from_args(
        kv_bits=w.bits, kv_group_size=args.kv_group_size, kv_key_bits=w.key_bits,
        kv_value_bits=w.value_bits, kv_rotation=w.rotation,
        quantized_kv_start=args.quantized_kv_start, max_kv_size=args.max_kv_size,
        allow_partial_kv=args.allow_partial_kv, kv_skip_layers=args.kv_skip_layers,
        kv_window_bits=w.window_bits, kv_key_scales=w.key_scales,
        kv_key_group_size=w.key_group_size, kv_residual=w.residual, kv_sinks=w.sinks,
    )  # fmt: skip


def kv_flag_names() -> tuple[str, ...]:
    """The attribute names of every KV flag (what `add_kv_flags` defines)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_kv_flags(parser)
    return tuple(vars(parser.parse_args([])))


def add_setting_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """`--setting FLAGS`, repeated: several KV settings in one run."""
    parser.add_argument(
        "--setting",
        action="append",
        default=None,
        metavar="FLAGS",
        help="a KV setting, as KV flags in one argument (e.g. '--kv-bits 4 --kv-rotation "
        f"hadamard'); repeat for several, {what}",
    )


def setting_namespaces(texts: list[str] | None, base: argparse.Namespace) -> list:
    """One namespace of KV flags per `--setting` text, parsed over the KV flags
    of `base` (the command's own; a setting sets what it names); `base`'s
    alone when there is none. A bad flag exits with status 2, naming the
    setting; a bad combination raises ValueError (`kv_config`), both before a
    model loads."""
    values = {name: getattr(base, name, None) for name in kv_flag_names()}
    if not texts:
        out = [argparse.Namespace(**values)]
    else:
        out = []
        for text in texts:
            parser = argparse.ArgumentParser(prog=f"--setting {text!r}", add_help=False)
            add_kv_flags(parser)
            defaults = vars(parser.parse_args([]))
            merged = {k: (defaults[k] if v is None and defaults[k] is not None else v)
                      for k, v in values.items()}  # fmt: skip
            ns = argparse.Namespace(**merged)
            out.append(parser.parse_args(shlex.split(text), namespace=ns))
    for ns in out:
        kv_config(ns)
    return out


# The sampling flags: (flag, SamplingParams field, type, help); each defaults
# to that field's default, mlx-lm's.
SAMPLING_FLAGS = (
    ("--temp", "temperature", float, "sampling temperature (0: greedy)"),
    ("--top-p", "top_p", float, "nucleus top-p"),
    ("--top-k", "top_k", int, "top-k (0: off)"),
    ("--min-p", "min_p", float, "min-p (0: off)"),
)


def add_sampling_flags(
    parser: argparse.ArgumentParser, max_tokens: int = DEFAULT_MAX_TOKENS
) -> None:
    """mlx-lm's sampling flags (for a server, the defaults of every request)."""
    defaults = SamplingParams()
    for flag, name, kind, text in SAMPLING_FLAGS:
        default = getattr(defaults, name)
        parser.add_argument(flag, type=kind, default=default, help=f"{text} (default: {default})")
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                        help=f"maximum tokens to generate (default: {max_tokens})")  # fmt: skip


def sampling_defaults(args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as `SamplingParams`; a value no sampler can use is a
    ValueError naming the flag (exit 2)."""
    given = {name: getattr(args, flag[2:].replace("-", "_")) for flag, name, _, _ in SAMPLING_FLAGS}
    try:
        return SamplingParams(max_tokens=args.max_tokens, **given)
    except SamplingError as e:
        flag = next((f for f, n, _, _ in SAMPLING_FLAGS if n == e.field), "--max-tokens")
        raise ValueError(f"{flag} {e.message}") from None


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_PROMPT_WORKERS = 2


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """Who may call the server, and how long and how many connections it waits on."""
    g = parser.add_argument_group("HTTP limits and browser access")
    g.add_argument(
        "--allowed-origins",
        type=_names,
        default=[],
        help="browser origins allowed besides the server's own and loopback ones, "
        "comma-separated, e.g. https://app.example.com; '*' allows any page (default: none)",
    )
    g.add_argument(
        "--allowed-hosts",
        type=_names,
        default=None,
        help="Host header names answered besides loopback ones, comma-separated ('*': any); "
        "default: loopback names only when bound to loopback, any otherwise",
    )
    g.add_argument(
        "--header-timeout",
        type=_positive(float),
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a connection may take to send a request's headers, idle connections "
        f"included, before it is closed (default: {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--body-timeout",
        type=_positive(float),
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request body may take to arrive after its headers; later gets 408 "
        f"(default: {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    g.add_argument(
        "--keep-alive-timeout",
        type=_positive(float),
        default=5.0,
        help="seconds an idle keep-alive connection is held between requests (default: 5)",
    )
    g.add_argument(
        "--max-connections",
        type=_positive(int),
        default=DEFAULT_MAX_CONNECTIONS,
        help="open connections at most; more are answered 503 and closed at once "
        f"(default: {DEFAULT_MAX_CONNECTIONS})",
    )
    g.add_argument(
        "--prompt-workers",
        type=_positive(int),
        default=DEFAULT_PROMPT_WORKERS,
        help="requests whose prompts are rendered and tokenized at once, off the event "
        f"loop; others wait their turn (default: {DEFAULT_PROMPT_WORKERS})",
    )


# -- serve ---------------------------------------------------------------------------
API_KEY_ENV = "MLX_KVQ_API_KEY"
DEFAULT_STEP_TIMEOUT_S = 300.0
DEFAULT_MAX_QUEUED = 256


class ServedModel(argparse.Action):
    """`serve --model`, repeatable: every one is served (`args.models`), the
    first is the default model (`args.model`, as for the other commands)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "models", None)
        models = [*(given if isinstance(given, list) else []), values]
        namespace.models = models
        namespace.model = models[0]


def add_served_models_flags(p: argparse.ArgumentParser) -> None:
    """The models one server serves and the memory they share."""
    p.add_argument(
        "--model",
        action=ServedModel,
        default=None,
        help="model directory or repo, a GGUF file (converted once into a cache directory; "
        "llama, qwen2, qwen3, gemma3), or an embedded demo model: demo:gemma (hybrid "
        "attention, the default) or demo:full (full attention on every layer); repeat to "
        f"serve several (the first is the default model, '{DEFAULT_MODEL_ALIAS}')",
    )
    p.set_defaults(models=None)
    p.add_argument(
        "--models-file",
        default=None,
        help="JSON or YAML file declaring models to serve, each with a name, aliases, its "
        "own flags (e.g. '--kv-bits 4 --kv-cache-memory 1GiB') and whether it stays pinned "
        "in memory (docs/server.md, 'Several models')",
    )
    p.add_argument(
        "--models-memory",
        type=parse_size,
        default=None,
        help="one memory budget for the weights and KV budgets of every resident model, "
        "e.g. 8GiB; a model that does not fit evicts idle, unpinned ones, least recently "
        "used first (default: the machine's share: half the RAM, or 90%% of Metal's "
        "working set; at least what the first model holds)",
    )
    p.add_argument(
        "--model-wait",
        type=float,
        default=DEFAULT_WAIT_S,
        help="seconds a request for a model that does not fit waits for a resident model "
        f"to become idle before a 503 with Retry-After (default: {DEFAULT_WAIT_S:g})",
    )
    p.add_argument(
        "--declared-models-only",
        action="store_true",
        help="serve only the models of --model and --models-file (any other name: 404); by "
        "default, as mlx_lm.server, a request naming a model directory, GGUF file or repo "
        "loads it",
    )


# The flags a model of --models-file may set for itself (argparse names); the
# others are the server's.
MODEL_FLAGS = frozenset({
    "kv_cache_memory", "kv_block_size", "adapter_path", "dtype", "trust_remote_code",
    "chat_template", "use_default_chat_template", "chat_template_args", "tool_format",
    "temp", "top_p", "top_k", "min_p", "max_tokens", "decode_concurrency",
    "prompt_concurrency", "prefill_step_size", "prompt_cache_size", "prompt_cache_bytes",
    "max_queued_requests",
})  # fmt: skip


def model_flags(base: argparse.Namespace, flags: list[str], where: str) -> argparse.Namespace:
    """`base` with what `flags` (serve flags, as one model's own) set; a
    ValueError naming `where` for a flag that is not a serve flag, a bad
    value, or a flag only the whole server can take (`MODEL_FLAGS` and the
    KV flags are a model's)."""
    parser = argparse.ArgumentParser(prog=where, add_help=False, exit_on_error=False)
    add_serve_flags(parser)
    unset = object()
    probe = argparse.Namespace(**{name: unset for name in vars(parser.parse_args([]))})
    try:
        parsed, unknown = parser.parse_known_args(flags, namespace=probe)
    except (argparse.ArgumentError, SystemExit) as e:
        raise ValueError(f"{where}: cannot read the flags {shlex.join(flags)}: {e}") from None
    if unknown:
        raise ValueError(f"{where}: {' '.join(unknown)} is not a flag of mlx-kvq serve")
    given = {name: value for name, value in vars(parsed).items() if value is not unset}
    server_wide = sorted(set(given) - MODEL_FLAGS - set(kv_flag_names()))
    if server_wide:
        named = ", ".join("--" + name.replace("_", "-") for name in server_wide)
        raise ValueError(f"{where}: {named} is the whole server's, not one model's")
    return argparse.Namespace(**{**vars(base), **given})


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """The `serve` flags: mlx_lm.server's names and meanings, plus ours."""
    add_served_models_flags(p)
    add_dtype_flag(p)
    add_adapter_flag(p)
    add_draft_flags(p)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id listed by /v1/models (default: the --model value)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="allow the tokenizer's custom code"
    )
    p.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    p.add_argument("--chat-template", default="", help="override the tokenizer's chat template")
    p.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="when the tokenizer has no chat template, use its default one (as mlx_lm.server; "
        "exit 2 when it has none)",
    )
    p.add_argument(
        "--tool-format",
        choices=[f.value for f in ToolFormat],
        default=ToolFormat.TEMPLATE.value,
        help="how tools reach the model: 'template' (the chat template renders them and "
        "mlx-lm's parser reads the calls; tools get 400 where it cannot) or 'json' (the "
        "generic format for templates that render no tools: the server describes the tools "
        "in a system block and holds the answer to plain text or one JSON tool call with a "
        "grammar); default: template",
    )
    p.add_argument(
        "--chat-template-args",
        type=json_object,
        default={},
        help="JSON object of apply_chat_template arguments, e.g. '{\"enable_thinking\":false}'",
    )
    add_sampling_flags(p)
    add_http_flags(p)
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="sequences decoded together in one batch (default: 32)",
    )
    p.add_argument(
        "--prompt-concurrency", type=int, default=8, help="prompts processed together (default: 8)"
    )
    add_prefill_step_flag(p)
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="maximum entries in the prompt cache (default: 10; 0 disables it)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        help="maximum bytes of KV held by the prompt cache, e.g. 2GB; while "
        "requests run, their KV bytes count against it too (as in mlx-lm)",
    )
    p.add_argument(
        "--prompt-cache-dir",
        default=None,
        help="directory of the prompt cache's disk tier: prompt-cache entries are written "
        "there in their quantized form (a prefix many prompts share once) and read back by a "
        "later request or a restarted server instead of prefilling; files of another model, "
        "KV setting or version are never loaded; several servers may share it "
        "(default: none, memory only)",
    )
    p.add_argument(
        "--prompt-cache-disk-bytes",
        type=parse_size,
        default=None,
        help="byte cap of --prompt-cache-dir, e.g. 20GB: every model's files in it count, the "
        f"least recently used go first (default: {DEFAULT_DISK_BYTES / 2**30:g}GiB)",
    )
    p.add_argument("--prompt-cache-write-gate", default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV memory budget: live sequences and the prompt cache together, e.g. 2GiB; "
        "a request is admitted when its prompt fits beside what running sequences hold "
        "(default: derived "
        "from the machine, less the weights, and printed at startup)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="tokens per block of the paged KV layout (full-attention and sliding-window "
        "layers held in blocks, shared prompt prefixes held once; default "
        f"{PAGED_BLOCK_SIZE}, or the least multiple of it that is whole key groups where the "
        "split layout's full-attention layers hold keys per channel: 128 with "
        "--kv-key-group-size 128, as in the full-attention default); those layers page only "
        "when a block is whole key groups, and keep padded rows by default with "
        "--prompt-cache-dir; 0 keeps mlx-lm's left-padded rows",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help="requests that may wait for admission; more get 429 with Retry-After "
        f"(default: {DEFAULT_MAX_QUEUED})",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' or 'x-api-key: <key>' on the API routes "
        f"(or set {API_KEY_ENV})",
    )
    p.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest accepted request body (default: 8MiB); larger gets 413",
    )
    p.add_argument(
        "--response-store-bytes",
        type=parse_size,
        default=DEFAULT_RESPONSE_STORE_BYTES,
        help="bytes of stored /v1/responses (store: true) kept for previous_response_id "
        "and GET /v1/responses/{id}, oldest dropped first (default: 64MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish "
        f"before they are answered with an error (default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})",
    )
    p.add_argument("--warmup-gate", default=None, help=argparse.SUPPRESS)
    add_kv_flags(p)
    g = p.add_argument_group("distributed (under mlx.launch)")
    add_pipeline_flag(g)
    g.add_argument(
        "--distributed-step-timeout",
        type=float,
        default=DEFAULT_STEP_TIMEOUT_S,
        help="fail the group when one engine step (a prefill chunk or a decode step on "
        f"every rank) takes longer than this many seconds (default {DEFAULT_STEP_TIMEOUT_S:g})",
    )


# -- generate ------------------------------------------------------------------------
GENERATE_MAX_TOKENS = 100  # mlx_lm.generate's --max-tokens


def add_generate_flags(g: argparse.ArgumentParser) -> None:
    """`mlx-kvq generate`: mlx_lm.generate's flags, plus ours."""
    add_model_flag(g)
    add_dtype_flag(g)
    add_adapter_flag(g)
    add_prompt_flag(g, "the prompt", default="And God said")
    add_sampling_flags(g, max_tokens=GENERATE_MAX_TOKENS)
    add_seed_flag(g)
    g.add_argument(
        "--ignore-chat-template",
        action="store_true",
        help="use the raw prompt without the tokenizer's chat template",
    )
    add_draft_flags(g)
    add_prompt_cache_file_flag(g, "prompt cache written by `mlx-kvq cache-prompt`")
    g.add_argument(
        "--verbose",
        action="store_true",
        help="print the whole plan table, and the bytes each cache slot holds at the end",
    )
    add_pipeline_flag(g)
    add_kv_flags(g)


# -- cache-prompt --------------------------------------------------------------------
def add_cache_prompt_flags(c: argparse.ArgumentParser) -> None:
    add_model_flag(c)
    add_dtype_flag(c)
    add_prompt_flag(c, "the prefix to cache (plain text)")
    add_prompt_cache_file_flag(c, "where to write the .safetensors file", required=True)
    add_prefill_step_flag(c)
    add_kv_flags(c)


# -- plan ----------------------------------------------------------------------------
def add_plan_flags(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    add_kv_flags(p)
    p.add_argument("--context", type=int, default=32768, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    add_json_flag(p)


# -- eval ----------------------------------------------------------------------------
def add_eval_flags(p: argparse.ArgumentParser) -> None:
    from ..evaluate import DEFAULT_CHUNK, DEFAULT_CONTEXT, DEFAULT_WINDOWS, HELD_CONTEXT

    add_model_flag(p)
    add_dtype_flag(p)
    p.add_argument(
        "--text",
        type=Path,
        action="append",
        default=None,
        help="text file to evaluate on; repeat for several (default with a demo model: "
        "its in-domain text, then its out-of-domain one: the held-out KJV and modern English)",
    )
    add_kv_flags(p)
    add_setting_flag(
        p,
        "all scored against one unquantized run; the KV flags outside --setting apply to "
        "every setting that does not set them",
    )
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens per window")
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK,
        help="tokens fed per forward pass (prefill chunk)",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        help="windows of --context tokens spread over each text",
    )
    p.add_argument(
        "--decode",
        type=int,
        default=0,
        help="feed the last N positions of each window one token at a time",
    )
    p.add_argument(
        "--held-context",
        type=int,
        default=HELD_CONTEXT,
        help="context at which bits per element are measured from the bytes held "
        f"(default {HELD_CONTEXT})",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="tokens per block of the paged layout scored (default: the server's for each "
        "setting, so that eval scores the logits the server computes; 0: each cache's own "
        "padded layout)",
    )
    add_json_flag(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# -- bench ---------------------------------------------------------------------------
def _tuple_ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def add_bench_flags(p: argparse.ArgumentParser) -> None:
    from ..bench.settings import DEFAULT_SECTIONS, MODELS, SECTIONS, BenchSettings

    d = BenchSettings()
    p.add_argument(
        "--quick", action="store_true", help="tiny setting (seconds), every section: for tests"
    )
    p.add_argument("--out", default="bench-results", help="output folder (JSON, markdown, PNG)")
    p.add_argument(
        "--sections",
        type=_tuple_names,
        default=None,
        help=f"comma-separated subset of {','.join(SECTIONS)} (default: "
        f"{','.join(DEFAULT_SECTIONS)}; servers: mlx-kvq serve against mlx_lm.server on --model; "
        "agents: coding-agent sessions against both servers on --model)",
    )
    p.add_argument(
        "--dtypes", type=_tuple_names, default=None, help=f"default {','.join(d.dtypes)}"
    )
    p.add_argument(
        "--bits", type=_tuple_ints, default=None, help="quantized settings to compare (default 8,4)"
    )
    p.add_argument("--kv-group-size", type=int, default=None, help="group size (default 64)")
    p.add_argument(
        "--model-size",
        choices=sorted(MODELS),
        default=None,
        help="benchmark model (default small: about 21M parameters)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="config.json (or a JSON string) of an mlx-lm model to build with random weights",
    )
    p.add_argument(
        "--contexts",
        type=_tuple_ints,
        default=None,
        help="model contexts (default 1024,4096,16384)",
    )
    p.add_argument(
        "--attn-contexts",
        type=_tuple_ints,
        default=None,
        help="cached tokens for attention alone (default 1024,4096,16384,32768)",
    )
    p.add_argument(
        "--attn-queries", type=_tuple_ints, default=None, help="queries per call (default 1,128)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="samples per figure for decode and attention (default 5)",
    )
    p.add_argument("--prefill-repeats", type=int, default=None, help="default 3")
    p.add_argument(
        "--serving-repeats", type=int, default=None, help="rounds per stream count (default 3)"
    )
    p.add_argument("--prefill-chunk", type=int, default=None, help="default 128")
    p.add_argument(
        "--reference-blas-contexts",
        type=_tuple_ints,
        default=None,
        help="model contexts also measured on MLX's linked reference BLAS, float32, "
        "both arms, labelled (default 4096; an empty string for none)",
    )
    p.add_argument("--memory-context", type=int, default=None, help="default 16384")
    p.add_argument(
        "--memory-dtype", default=None, help="model dtype of the memory and serving sections"
    )
    p.add_argument(
        "--streams", type=_tuple_ints, default=None, help="concurrent streams (default 1,4,16)"
    )
    p.add_argument(
        "--mlx-lm-max-call-s",
        type=float,
        default=None,
        help="skip mlx-lm attention cells predicted to take longer per call (default 30)",
    )
    p.add_argument(
        "--budget-memory",
        type=parse_size,
        default=None,
        help="KV budget of the budget section, e.g. 64MiB (default: what 4 unquantized "
        "sequences need)",
    )
    p.add_argument(
        "--budget-requests", type=int, default=None, help="requests of the budget section (16)"
    )
    p.add_argument(
        "--budget-prompt", type=int, default=None, help="prompt tokens per request there (128)"
    )
    p.add_argument(
        "--budget-tokens", type=int, default=None, help="generated tokens per request there (128)"
    )
    add_model_flag(p)
    p.add_argument(
        "--server-arms",
        type=_arms,
        default=None,
        help="servers section: the mlx-kvq serve flags of each arm, ';'-separated, 'default' "
        "for none (default: 'default;--kv-bits 0'); mlx_lm.server is always the baseline",
    )
    p.add_argument(
        "--server-streams",
        type=_tuple_ints,
        default=None,
        help=f"servers section: concurrent requests (default {_csv(d.server_streams)})",
    )
    p.add_argument(
        "--server-prompt",
        type=int,
        default=None,
        help=f"servers section: prompt tokens per request (default {d.server_prompt})",
    )
    p.add_argument(
        "--server-tokens",
        type=int,
        default=None,
        help=f"servers section: answer tokens per request (default {d.server_tokens})",
    )
    p.add_argument(
        "--server-mixed",
        type=_mixed,
        default=None,
        help="servers section: one long prompt beside short ones, LONG,SHORT,COUNT tokens "
        f"(default {_csv(d.server_mixed)}; 0,0,0 for none)",
    )
    p.add_argument(
        "--server-long",
        type=int,
        default=None,
        help="servers section: time to first token on a prompt of this many tokens, cold "
        f"and repeated (default {d.server_long}; 0 for none)",
    )
    p.add_argument(
        "--server-rounds",
        type=int,
        default=None,
        help=f"servers section (default {d.server_rounds})",
    )
    p.add_argument(
        "--server-starts",
        type=int,
        default=None,
        help="servers section: timed starts of each server, each alone on the machine, in "
        f"alternating order (default {d.server_starts})",
    )
    p.add_argument(
        "--server-text",
        default=None,
        help="servers section: the text prompts are cut from (default: the demo texts)",
    )
    _add_agent_flags(p, d)
    add_setting_flag(
        p,
        "each measured in the model section beside --bits (decode and prefill against unquantized)",
    )
    p.add_argument("--no-plots", action="store_true")
    add_seed_flag(p)


def _add_agent_flags(p: argparse.ArgumentParser, d) -> None:
    """The agents section's flags: the arms and the workload's sizes."""
    p.add_argument(
        "--agent-arms",
        type=_arms,
        default=None,
        help="agents section: the mlx-kvq serve flags of each arm, ';'-separated, 'default' "
        "for none (default: 'default;--kv-bits 0'); mlx_lm.server is always the baseline",
    )
    p.add_argument(
        "--agent-sessions",
        type=_positive(int),
        default=None,
        help=f"agents section: sessions at once (default {d.agent_sessions})",
    )
    p.add_argument(
        "--agent-turns",
        type=_positive(int),
        default=None,
        help=f"agents section: turns per session (default {d.agent_turns})",
    )
    p.add_argument(
        "--agent-system",
        type=_positive(int),
        default=None,
        help="agents section: tokens of the shared system prompt, an agent's instructions "
        f"and tool list in JSON, at most (default {d.agent_system})",
    )
    p.add_argument(
        "--agent-tool-chars",
        type=_positive(int),
        default=None,
        help="agents section: characters of Python source in each turn's tool result, about "
        f"(default {d.agent_tool_chars})",
    )
    p.add_argument(
        "--agent-tokens",
        type=_positive(int),
        default=None,
        help=f"agents section: greedy answer tokens per turn, at most (default {d.agent_tokens})",
    )
    p.add_argument(
        "--agent-rewrite",
        type=int,
        default=None,
        help="agents section: the turn from which each session's first tool result is "
        f"replaced by a placeholder (default {d.agent_rewrite}; 0 for none)",
    )
    p.add_argument(
        "--agent-api",
        choices=("auto", "chat", "completions"),
        default=None,
        help="agents section: /v1/chat/completions with messages, or /v1/completions with "
        "the history as plain text (default auto: chat if the model has a chat template)",
    )
    p.add_argument(
        "--agent-sources",
        default=None,
        help="agents section: a folder whose .py files the tool results are cut from "
        "(default: the Python standard library)",
    )


def _csv(values: tuple) -> str:
    return ",".join(str(v) for v in values)


def _arms(text: str) -> tuple[str, ...]:
    parts = [p.strip() for p in text.split(";")]
    return tuple("" if p in ("", "default") else p for p in parts)


def _mixed(text: str) -> tuple[int, int, int]:
    values = _tuple_ints(text)
    if len(values) != 3 or min(values) < 0:
        raise argparse.ArgumentTypeError("LONG,SHORT,COUNT: three token counts, e.g. 4096,256,15")
    return values  # type: ignore[return-value]


def _tuple_names(text: str) -> tuple[str, ...]:
    return tuple(_names(text))


# -- convert -------------------------------------------------------------------------
DTYPE_CHOICES = ("float32", "float16", "bfloat16")


def add_convert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf", help="the GGUF file (llama, qwen2, qwen3 or gemma3)")
    p.add_argument("out_dir", help="the directory to write (must not exist, or be empty)")
    p.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default=None,
        help="dtype of the dense tensors (default: float32 on MLX's CPU backend, whose "
        "half-precision products do not use the BLAS; float16 elsewhere)",
    )
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="make every weight dense, also the block types MLX's quantization holds "
        "exactly (kept packed by default): on the CPU backend the fastest form, at "
        "4-8x the bytes",
    )
