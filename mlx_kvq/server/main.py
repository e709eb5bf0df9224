"""`mlx-kvq serve`: a drop-in for `mlx_lm.server` with quantized, batched KV caches.

Startup order matters: settings are checked, the model is loaded, the
per-layer KV plan is built and validated, and the batch path is checked,
all before the port opens, so an unsupported setting exits non-zero with the
plan's message. The port then opens with `/health` at 503 while the engine
warms up.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlx_kvq.engine import EngineOptions

log = logging.getLogger("mlx_kvq.server")

EXIT_BAD_SETTING = 2
API_KEY_ENV = "MLX_KVQ_API_KEY"
DEMO_MODEL_ID = "mlx-kvq-demo"

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


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The `serve` flags: mlx_lm.server's names and meanings, plus ours."""
    from mlx_kvq.cli import add_kv_args
    from mlx_kvq.defaults import DEFAULT_KV_CONFIG

    parser.add_argument(
        "--model", default=None, help="model directory or repo (default: the embedded demo model)"
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="model id listed by /v1/models (default: the --model value)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    parser.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default=["*"],
        help="CORS allowed origins, comma-separated (default: *)",
    )
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="allow the tokenizer's custom code"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
    )
    parser.add_argument(
        "--chat-template", default="", help="override the tokenizer's chat template"
    )
    parser.add_argument(
        "--chat-template-args",
        type=_json_object,
        default={},
        help="JSON object of apply_chat_template arguments, e.g. '{\"enable_thinking\":false}'",
    )
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus top-p")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k (0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p (0: off)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="default maximum tokens to generate (default: 512)",
    )
    parser.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="sequences decoded together in one batch (default: 32)",
    )
    parser.add_argument(
        "--prompt-concurrency", type=int, default=8, help="prompts processed together (default: 8)"
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="prompt tokens per prefill step (default: 2048)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="maximum entries in the prompt cache (default: 10; 0 disables it)",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=parse_size,
        default=None,
        help="maximum bytes of KV held by the prompt cache, e.g. 2GB; while "
        "requests run, their KV bytes count against it too (as in mlx-lm)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' on /v1/* (or set {API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=parse_size,
        default=8 * 1024 * 1024,
        help="largest accepted request body (default: 8MiB); larger gets 413",
    )
    parser.add_argument("--warmup-gate", default=None, help=argparse.SUPPRESS)
    add_kv_args(parser, DEFAULT_KV_CONFIG.bits)
    from mlx_kvq.distributed.serve import add_args as add_distributed_args

    add_distributed_args(parser)  # --pipeline, --distributed-step-timeout


def _fail(message: str) -> int:
    log.error("%s", message)
    print(f"mlx-kvq serve: error: {message}", file=sys.stderr)
    return EXIT_BAD_SETTING


def _resolve_model(args: argparse.Namespace) -> tuple[str, str]:
    """(path or repo to load, model id to serve under)."""
    if args.model:
        return args.model, args.served_model_name or args.model
    try:
        from mlx_kvq.demo import demo_model_path

        path = demo_model_path()
    except (ImportError, AttributeError, FileNotFoundError, OSError) as e:
        raise FileNotFoundError(
            "no --model given and the embedded demo model is not available in this "
            f"installation ({type(e).__name__}: {e}); pass --model PATH"
        ) from None
    return str(path), args.served_model_name or DEMO_MODEL_ID


def serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted; non-zero exit for settings refused at startup."""
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from mlx_kvq.cli import kv_config_from_args
    from mlx_kvq.config import UnsupportedKVConfig
    from mlx_kvq.distributed import launched

    if launched():  # one rank of an mlx.launch group: see mlx_kvq/distributed/serve.py
        from mlx_kvq.distributed.serve import serve as serve_rank

        return serve_rank(args)
    try:
        kv_config = kv_config_from_args(args)
        _check_numbers(args)
        source, model_id = _resolve_model(args)
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))

    try:
        model, tokenizer = _load(source, args)
    except Exception as e:
        return _fail(f"could not load the model from {source}: {type(e).__name__}: {e}")

    from mlx_kvq.caches import cache_report
    from mlx_kvq.engine import Engine, check_batch_path
    from mlx_kvq.engine.warmup import warmup_spec
    from mlx_kvq.plan import plan_kv

    try:
        plan = plan_kv(model, kv_config, batch=True)
        check_batch_path(plan.make_cache, cache_report, kv_config, plan.max_batch)
        warmup_spec(plan.max_window, kv_config, plan.max_context)
    except UnsupportedKVConfig as e:
        return _fail(f"KV setting refused for {model_id}: {e}")
    log.info("KV plan for %s:\n%s", model_id, plan.table())

    options = engine_options(args, plan.max_context, args.warmup_gate, plan.max_batch)
    engine = Engine(model, tokenizer, plan, kv_config, options)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    settings = _settings(args, model_id, plan, api_key)
    return _run(engine, settings, args.host, args.port, args.log_level)


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("max_tokens", "decode_concurrency", "prompt_concurrency", "prefill_step_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.prompt_cache_size < 0:
        raise ValueError("--prompt-cache-size must be >= 0")
    if not 0 < args.top_p <= 1:
        raise ValueError("--top-p must be in (0, 1]")
    if args.temp < 0:
        raise ValueError("--temp must be >= 0")


def _load(source: str, args: argparse.Namespace) -> tuple[Any, Any]:
    from mlx_lm import load

    tokenizer_config: dict[str, Any] = {}
    if args.trust_remote_code:
        tokenizer_config["trust_remote_code"] = True
    if args.chat_template:
        tokenizer_config["chat_template"] = args.chat_template
    return load(source, tokenizer_config=tokenizer_config)


def engine_options(
    args: argparse.Namespace,
    max_context: int | None,
    warmup_gate: str | None,
    max_batch: int | None = None,
) -> EngineOptions:
    """The engine's scheduling and prompt-cache settings from the serve flags.

    `max_batch` is the plan's limit (deepseek_v41 runs one sequence at a
    time, as in mlx-lm's server): the concurrency flags are capped to it, and
    the log says so."""
    from mlx_kvq.engine import EngineOptions

    decode, prompt = args.decode_concurrency, args.prompt_concurrency
    if max_batch is not None and max(decode, prompt) > max_batch:
        log.warning(
            "this model runs %d sequence(s) at a time: --decode-concurrency %d and "
            "--prompt-concurrency %d are capped to %d (requests queue)",
            max_batch, decode, prompt, max_batch,
        )  # fmt: skip
        decode, prompt = min(decode, max_batch), min(prompt, max_batch)
    return EngineOptions(
        decode_concurrency=decode,
        prompt_concurrency=prompt,
        prefill_step_size=args.prefill_step_size,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        max_context=max_context,
        warmup_gate=warmup_gate,
    )


def _settings(args: argparse.Namespace, model_id: str, plan: Any, api_key: str | None):
    from .app import ServerSettings

    return ServerSettings(
        model_id=model_id,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        chat_template_args=dict(args.chat_template_args),
        max_context=plan.max_context,
        plan=plan.to_dict(),
        allowed_origins=args.allowed_origins,
    )


def _run(engine: Any, settings: Any, host: str, port: int, log_level: str) -> int:
    import uvicorn

    from .app import create_app

    app = create_app(engine, settings)
    engine.start()
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=False,
        timeout_graceful_shutdown=5,
    )  # fmt: skip
    server = uvicorn.Server(config)
    try:
        server.run()
    finally:
        engine.stop()
    return 0 if server.started else 1
