"""Every flag that more than one command takes, defined once.

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

from ..config import KEY_SCALES, ROTATIONS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES, KVConfig
from ..defaults import resolve_widths
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


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help="model directory or repo, or an embedded demo model: demo:gemma (hybrid "
        "attention, the default) or demo:full (full attention on every layer)",
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
        help="bits for keys and values (2,3,4,5,6,8; 0: unquantized); "
        "default: mlx_kvq/defaults.py (4-bit keys, 3-bit values, rotation, 8-bit "
        "bounded layers)",
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
        "--max-kv-size; 0: unquantized); default: as the other layers (with no bits "
        "flag: the default setting's, 8)",
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
        help="the last N tokens of every layer stay unquantized (in 16 bits), quantized as "
        "newer ones arrive; default: 0 with explicit bits, the default setting's without",
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
    alone when there is none. A bad flag exits with status 2, naming the setting."""
    values = {name: getattr(base, name, None) for name in kv_flag_names()}
    if not texts:
        return [argparse.Namespace(**values)]
    out = []
    for text in texts:
        parser = argparse.ArgumentParser(prog=f"--setting {text!r}", add_help=False)
        add_kv_flags(parser)
        defaults = vars(parser.parse_args([]))
        merged = {k: (defaults[k] if v is None and defaults[k] is not None else v)
                  for k, v in values.items()}  # fmt: skip
        out.append(parser.parse_args(shlex.split(text), namespace=argparse.Namespace(**merged)))
    return out


def add_sampling_flags(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """mlx-lm's sampling flags (defaults for every request of a server)."""
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus top-p")
    parser.add_argument("--top-k", type=int, default=0, help="top-k (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="min-p (0: off)")
    parser.add_argument("--max-tokens", "-m", type=int, default=max_tokens,
                        help=f"maximum tokens to generate (default: {max_tokens})")  # fmt: skip


def check_sampling(args: argparse.Namespace) -> None:
    """Refuse sampling defaults no request could use."""
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    if args.temp < 0:
        raise ValueError("--temp must be >= 0")
    if not 0 < args.top_p <= 1:
        raise ValueError("--top-p must be in (0, 1]")
    if args.top_k < 0:
        raise ValueError("--top-k must be >= 0")
    if not 0 <= args.min_p <= 1:
        raise ValueError("--min-p must be in [0, 1]")


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
