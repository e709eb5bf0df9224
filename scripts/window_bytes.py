"""What one sliding-window layer holds, step by step, under each KV setting.

A window in the split layout drops its quantized body a whole key group at
a time and keeps its newest tokens exact, so its bytes are a sawtooth; a
per-token window holds a flat line. This decodes past the window and prints
the least and the most one sliding layer held, against the window at its
stored width per token:

    python scripts/window_bytes.py --model /work/models/gemma3-270m-f32 \\
        --setting "--kv-key-bits 6 --kv-value-bits 5 --kv-key-scales channel \\
                   --kv-key-group-size 128 --kv-sinks 4 --kv-residual 64" \\
        --setting ""
"""

from __future__ import annotations

import argparse

import mlx.core as mx


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=300, help="tokens decoded past the prompt")

    from mlx_kvq.commands.flags import add_setting_flag, setting_namespaces

    add_setting_flag(ap, "each measured in turn ('': the default)")
    a = ap.parse_args()

    from mlx_lm import load

    from mlx_kvq.commands.startup import ModelSource, kv_setting
    from mlx_kvq.engine.budget import setting_label
    from mlx_kvq.generate import generate_step
    from mlx_kvq.plan import plan_kv

    model, _ = load(a.model)
    for ns in setting_namespaces(a.setting, argparse.Namespace()):
        kv = kv_setting(ns, ModelSource("", ""), model)
        plan = plan_kv(model, kv)
        cache = plan.make_cache()
        kinds = [plan.layer(i).kind for i in range(len(cache))]
        if "sliding" not in kinds:
            raise SystemExit(f"{a.model} has no sliding-window layer")
        i = kinds.index("sliding")
        window = plan.layer(i).window
        prompt = mx.arange(1000, 1000 + window + 8)
        held = []
        for _ in generate_step(prompt, model, prompt_cache=cache, max_tokens=a.tokens):
            held.append(cache[i].nbytes)
        flat = window * plan.layer(i).bytes_per_token()
        print(
            f"{setting_label(kv)}: one sliding layer "
            f"(window {window}) held {min(held):,}-{max(held):,} bytes over {len(held)} steps, "
            f"{min(held) / flat:.2f}-{max(held) / flat:.2f}x its window at {flat / window:,.0f} "
            "bytes per token"
        )


if __name__ == "__main__":
    main()
