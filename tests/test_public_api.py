"""The public API of `mlx_kvq`, and that importing it stays light."""

from __future__ import annotations

import subprocess
import sys

import mlx_kvq

PUBLIC = [
    "make_prompt_cache", "generate_step", "stream_generate", "generate", "plan_kv",
    "KVConfig", "UnsupportedKVConfig", "KVPlan", "save_prompt_cache", "load_prompt_cache",
]  # fmt: skip


def test_import_is_light():
    """`import mlx_kvq` loads neither mlx-lm (whose package import pulls in
    transformers) nor our caches; the entry points load on first use."""
    code = (
        "import sys, mlx_kvq\n"
        "heavy = [m for m in ('mlx_lm', 'transformers', 'mlx_kvq.generate', 'mlx_kvq.caches')"
        " if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "assert mlx_kvq.KVConfig(bits=4).enabled\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_line_leaves_the_http_stack_for_the_warm_up():
    """The commands and their flags load without the HTTP stack: `serve`
    imports it (fastapi, uvicorn: about 0.5 s here) once its engine has
    started warming up, so the two overlap."""
    code = (
        "import sys\n"
        "from mlx_kvq.commands import build_parser\n"
        "args = build_parser().parse_args(['serve', '--model', 'm'])\n"
        "assert args.shutdown_timeout == 30.0\n"
        "http = [m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules]\n"
        "assert not http, http\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_names_resolve():
    from mlx_kvq import attention, generate, plan

    for name in PUBLIC:
        assert name in mlx_kvq.__all__
        assert getattr(mlx_kvq, name) is not None
    assert mlx_kvq.make_prompt_cache is generate.make_prompt_cache
    assert mlx_kvq.plan_kv is plan.plan_kv and mlx_kvq.KVPlan is plan.KVPlan
    assert issubclass(mlx_kvq.UnsupportedKVConfig, ValueError)
    # Planning (what every entry point does first) installs the attention redirect.
    import mlx_lm.models.base as mlx_base

    plan.plan_kv({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
                  "intermediate_size": 32, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
                  "vocab_size": 16})  # fmt: skip
    assert mlx_base.scaled_dot_product_attention is attention.scaled_dot_product_attention


def test_generate_is_callable_and_the_module():
    """`mlx_kvq.generate` is the function (as in mlx-lm) and the module
    (`mlx_kvq.generate.save_prompt_cache`), whichever was imported first."""
    import mlx_kvq.generate  # noqa: F401  (binds the submodule to the package)

    assert callable(mlx_kvq.generate)
    assert mlx_kvq.generate.save_prompt_cache is mlx_kvq.save_prompt_cache
    assert mlx_kvq.generate.load_prompt_cache is mlx_kvq.load_prompt_cache
