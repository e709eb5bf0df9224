"""`mlx-kvq serve | generate | plan | eval | bench`.

Flag names follow mlx-lm (`--model`, `--kv-bits`, `--kv-group-size`,
`--quantized-kv-start`, `--max-kv-size`, ...). A bad setting exits with
status 2 and the error message, before weights are loaded wherever the
config alone decides it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .config import KVConfig, UnsupportedKVConfig

EXIT_BAD_SETTING = 2


def add_kv_args(parser: argparse.ArgumentParser, default_bits: int | None = None) -> None:
    """KV flags shared by every subcommand (mlx-lm names, plus ours)."""
    g = parser.add_argument_group("KV cache")
    del default_bits  # the default setting is resolved in kv_config_from_args
    g.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="bits for keys and values (2,3,4,5,6,8); 0 turns quantization off; "
        "default: mlx_kvq/defaults.py",
    )
    g.add_argument("--kv-group-size", type=int, default=64, help="quantization group size")
    g.add_argument(
        "--kv-key-bits", type=int, default=None, help="bits for keys (overrides --kv-bits)"
    )
    g.add_argument(
        "--kv-value-bits", type=int, default=None, help="bits for values (overrides --kv-bits)"
    )
    g.add_argument(
        "--kv-rotation",
        choices=["none", "hadamard"],
        default=None,
        help="rotate K/V with a Hadamard transform before quantizing",
    )
    g.add_argument(
        "--kv-window-bits",
        type=int,
        default=None,
        help="bits for keys and values of bounded layers (sliding window, chunked, "
        "--max-kv-size); default: as the other layers (with no bits flag: mlx_kvq/defaults.py)",
    )
    g.add_argument(
        "--quantized-kv-start",
        type=int,
        default=0,
        help="tokens held in full precision before quantization starts (mlx-lm default 5000; ours 0)",
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
    g.add_argument("--kv-skip-layers", type=lambda s: [int(x) for x in s.split(",") if x],
                   default=None, help="comma-separated cache slots to leave unquantized")  # fmt: skip


def kv_config_from_args(args: argparse.Namespace) -> KVConfig:
    """The KV setting asked for on the command line.

    With none of `--kv-bits`, `--kv-key-bits`, `--kv-value-bits` given, the
    default from `mlx_kvq/defaults.py` applies (bits and rotation);
    `--kv-bits 0` turns quantization off.
    """
    from .defaults import resolve_widths

    w = resolve_widths(
        args.kv_bits, args.kv_key_bits, args.kv_value_bits, args.kv_rotation,
        args.kv_window_bits,
    )  # fmt: skip
    return KVConfig.from_args(
        kv_bits=w.bits or None, kv_group_size=args.kv_group_size, kv_key_bits=w.key_bits,
        kv_value_bits=w.value_bits, kv_rotation=w.rotation,
        quantized_kv_start=args.quantized_kv_start, max_kv_size=args.max_kv_size,
        allow_partial_kv=args.allow_partial_kv, kv_skip_layers=args.kv_skip_layers,
        kv_window_bits=w.window_bits,
    )  # fmt: skip


def _model_path(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from .demo import demo_model_path

    return demo_model_path()


def _fail(message: str) -> int:
    print(f"mlx-kvq: error: {message}", file=sys.stderr)
    return EXIT_BAD_SETTING


# -- plan --------------------------------------------------------------------
def cmd_plan(args: argparse.Namespace) -> int:
    from .plan import plan_kv

    cfg = kv_config_from_args(args)
    path = _model_path(args)
    if not (path / "config.json").exists() and not path.is_file():
        return _fail(f"no config.json at {path}")
    plan = plan_kv(path, cfg)
    estimate = plan.estimate(args.context, args.batch)
    if args.json:
        print(json.dumps({**plan.to_dict(), "estimate": estimate}, indent=2, default=str))
        return 0
    print(plan.table())
    print()
    print(f"estimate at {args.context} tokens x batch {args.batch}:")
    for kind, e in estimate["by_kind"].items():
        print(
            f"  {kind:<8} {e['layers']:>3} slots  {_mib(e['bytes']):>10}  (fp16 {_mib(e['fp16_bytes'])})"
        )
    print(
        f"  total          {_mib(estimate['bytes']):>10}  (fp16 {_mib(estimate['fp16_bytes'])}, "
        f"ratio {estimate['ratio']:.3f})"
    )
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


# -- generate ----------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from .distributed import launched

    if launched():  # one rank of an `mlx.launch` group: sharded load, plan on every rank
        from .distributed.generate import cli_generate

        return cli_generate(args)
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.sample_utils import make_sampler

    from .caches import cache_report
    from .generate import check_prompt_cache_settings, get_plan, load_prompt_cache, stream_generate
    from .plan import plan_kv

    cfg = kv_config_from_args(args)
    path = _model_path(args)
    if cfg.enabled and (path / "config.json").exists():
        plan_kv(path, cfg)  # refuse bad settings before loading weights
    model, tokenizer = load(str(path))
    draft = None
    if args.draft_model:
        draft, _ = load(args.draft_model)

    prompt_cache = None
    if args.prompt_cache_file:
        prompt_cache, meta = load_prompt_cache(args.prompt_cache_file, return_metadata=True)
        check_prompt_cache_settings(prompt_cache, cfg, args.prompt_cache_file)
    plan = get_plan(model, cfg) if cfg.enabled else None
    print(
        plan.table()
        if (plan and args.verbose)
        else (plan.summary() if plan else "KV cache: unquantized")
    )
    print("=" * 10)

    prompt = args.prompt.replace("\\n", "\n")
    use_template = not args.ignore_chat_template and tokenizer.chat_template is not None
    if prompt_cache is not None:
        # The file holds the prefix; the prompt continues it as plain text.
        print(f"prompt cache: {meta.get('tokens', '?')} tokens of {args.prompt_cache_file!r}")
    elif use_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokens = tokenizer.encode(prompt, add_special_tokens=prompt_cache is None and not use_template)

    cache = prompt_cache
    if cache is None and cfg.enabled and draft is None:
        cache = plan.make_cache()
    sampler = make_sampler(args.temp, args.top_p)
    kwargs = dict(max_tokens=args.max_tokens, sampler=sampler, prompt_cache=cache)
    if draft is not None:
        kwargs["num_draft_tokens"] = args.num_draft_tokens
    kw_kv = dict(
        kv_bits=cfg.bits, kv_group_size=cfg.group_size, kv_key_bits=cfg.key_bits,
        kv_value_bits=cfg.value_bits, kv_rotation=cfg.rotation,
        quantized_kv_start=cfg.quantized_start, max_kv_size=cfg.max_kv_size,
        kv_window_bits=cfg.window_bits,
    )  # fmt: skip
    mx.reset_peak_memory()
    response = None
    if args.seed is not None:
        mx.random.seed(args.seed)
    for response in stream_generate(model, tokenizer, tokens, draft_model=draft, **kwargs, **kw_kv):
        print(response.text, end="", flush=True)
    print()
    print("=" * 10)
    if response is None:
        print("No text generated for this prompt")
        return 0
    held = sum(r["nbytes"] for r in cache_report(cache)) if cache is not None else 0
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
    print(
        f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec"
    )
    print(f"Peak memory: {mx.get_peak_memory() / 1e9:.3f} GB")
    if cache is not None:
        print(f"KV bytes held: {held} ({held / 2**20:.2f} MiB)")
    return 0


# -- cache-prompt ------------------------------------------------------------
def cmd_cache_prompt(args: argparse.Namespace) -> int:
    """Process a prefix once and save its (quantized) caches, like mlx_lm.cache_prompt."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from .caches import cache_report
    from .generate import get_plan, save_prompt_cache
    from .plan import plan_kv

    cfg = kv_config_from_args(args)
    path = _model_path(args)
    if cfg.enabled:
        plan_kv(path, cfg)
    model, tokenizer = load(str(path))
    plan = get_plan(model, cfg) if cfg.enabled else None
    print(plan.summary() if plan else "KV cache: unquantized")
    cache = plan.make_cache() if plan else make_prompt_cache(model, max_kv_size=cfg.max_kv_size)
    tokens = mx.array(tokenizer.encode(args.prompt.replace("\\n", "\n")))
    for start in range(0, tokens.size, args.prefill_step_size):
        model(tokens[None, start : start + args.prefill_step_size], cache=cache)
        mx.eval([c.state for c in cache])
    save_prompt_cache(
        args.prompt_cache_file, cache,
        {"model": str(path), "tokens": str(tokens.size), "kv": cfg.describe()},
    )  # fmt: skip
    held = sum(r["nbytes"] for r in cache_report(cache))
    print(f"saved {tokens.size} tokens to {args.prompt_cache_file} ({held} KV bytes held)")
    return 0


# -- the parser --------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-kvq", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    from .defaults import DEFAULT_KV_CONFIG

    default_bits = DEFAULT_KV_CONFIG.bits

    p = sub.add_parser("plan", help="per-layer KV plan and memory estimate from config.json")
    p.add_argument("--model", default=None, help="model directory (default: embedded demo model)")
    add_kv_args(p, default_bits)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    g = sub.add_parser(
        "generate", help="generate text like mlx_lm.generate, every KV layer quantized"
    )
    g.add_argument("--model", default=None, help="model directory (default: embedded demo model)")
    g.add_argument("--prompt", "-p", default="And God said")
    g.add_argument("--max-tokens", "-m", type=int, default=100)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-chat-template", action="store_true")
    g.add_argument("--draft-model", default=None, help="draft model for speculative decoding")
    g.add_argument("--num-draft-tokens", type=int, default=3)
    g.add_argument(
        "--prompt-cache-file", default=None, help="prompt cache from `mlx-kvq cache-prompt`"
    )
    g.add_argument("--verbose", action="store_true", help="print the whole plan table")
    g.add_argument(
        "--pipeline",
        action="store_true",
        help="under mlx.launch: pipeline parallel (layers split over ranks) instead of "
        "tensor parallel (heads split over ranks), as in mlx-lm",
    )
    add_kv_args(g, default_bits)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("cache-prompt", help="process a prefix once and save its quantized caches")
    c.add_argument("--model", default=None, help="model directory (default: embedded demo model)")
    c.add_argument("--prompt", "-p", required=True, help="the prefix to cache (plain text)")
    c.add_argument(
        "--prompt-cache-file", required=True, help="where to write the .safetensors file"
    )
    c.add_argument("--prefill-step-size", type=int, default=2048)
    add_kv_args(c, default_bits)
    c.set_defaults(func=cmd_cache_prompt)

    _add_optional(
        sub, "serve", "OpenAI-compatible server", "mlx_kvq.server.main", "add_serve_args", "serve"
    )
    _add_optional(
        sub,
        "eval",
        "perplexity/KL/top-1 against unquantized",
        "mlx_kvq.evaluate",
        "add_eval_args",
        "run_eval",
    )
    _add_optional(
        sub,
        "bench",
        "speed and memory benchmark",
        "mlx_kvq.bench.cli",
        "add_bench_args",
        "run_bench",
    )
    return parser


def _add_optional(sub, name: str, help_text: str, module: str, add: str, run: str) -> None:
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        p = sub.add_parser(name, help=f"{help_text} (unavailable: {e})")
        p.set_defaults(func=lambda _a, e=e: _fail(f"{name} is unavailable: {e}"))
        return
    p = sub.add_parser(name, help=help_text)
    getattr(mod, add)(p)
    p.set_defaults(func=getattr(mod, run))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except (UnsupportedKVConfig, ValueError) as e:
        return _fail(str(e))
    except FileNotFoundError as e:
        return _fail(str(e))
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
