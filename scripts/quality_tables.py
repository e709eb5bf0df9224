"""Regenerate the tables of docs/quality.md.

    python scripts/quality_tables.py                 # every section
    python scripts/quality_tables.py --only demo     # the demo model only
    python scripts/quality_tables.py --only outlier  # the outlier-key model only

Each table is written between `<!-- BEGIN name -->` / `<!-- END name -->`
markers in docs/quality.md (the prose around them is left alone), and the raw
numbers go to docs/quality.json. Sections:

- demo: the embedded demo model (gemma3_text, head_dim 64, sliding window
  128) on its held-out text, through `mlx_kvq.evaluate.evaluate_many`: every
  setting against one shared unquantized run, chunked prefill through the
  caches.
- outlier: a random-weight llama whose keys carry a few large channels
  (k_proj rows of two RoPE pairs per KV head scaled by 8x and 16x, the
  matching q_proj rows divided by the same factor, so the unquantized model
  computes exactly the same function as the control without outliers).
  Attention-output error per layer call (keys and values quantized
  separately) and end-to-end KL, with and without Hadamard rotation.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import mlx.core as mx  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlx_kvq import attention  # noqa: E402
from mlx_kvq.config import KVConfig, QuantSpec  # noqa: E402
from mlx_kvq.evaluate import evaluate_many, format_table, load_eval_inputs  # noqa: E402
from mlx_kvq.quant import Store  # noqa: E402

DOC = REPO / "docs" / "quality.md"
RAW = REPO / "docs" / "quality.json"


# -- demo model ----------------------------------------------------------------------
def demo_settings() -> list[tuple[str, KVConfig]]:
    out = []
    for bits in (8, 6, 5, 4, 3, 2):
        for rot in ("none", "hadamard"):
            out.append((f"{bits}-bit", KVConfig(bits=bits, rotation=rot)))
    mixed = [(8, 4), (4, 8), (4, 3), (3, 4), (4, 2), (2, 4), (3, 2), (2, 3)]
    for kb, vb in mixed:
        for rot in ("none", "hadamard"):
            out.append((f"K{kb}/V{vb}", KVConfig(key_bits=kb, value_bits=vb, rotation=rot)))
    return out


def run_demo(args, settings=None) -> dict:
    model, _, ids, bos = load_eval_inputs(args.model, args.text)
    settings = settings or demo_settings()
    t0 = time.perf_counter()
    results = evaluate_many(
        model, ids, [c for _, c in settings], context=args.context, chunk=args.chunk,
        windows=args.windows, bos=bos, progress=True,
    )  # fmt: skip
    print(f"demo: {len(settings)} settings in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}


# -- outlier-key model ---------------------------------------------------------------------
OUTLIER_PAIRS = {5: 8.0, 30: 16.0}  # RoPE pair index (i, i + head_dim/2) -> key scale


def outlier_model(outliers: bool, seed: int = 0):
    """A random float32 llama (4 layers, 4 query / 2 KV heads, head_dim 64).

    q_proj and k_proj are scaled up so attention is selective (scores with a
    standard deviation of a few units, as in trained models). With
    `outliers`, two RoPE pairs of every KV head get large key channels: the
    k_proj rows are multiplied by the factors of OUTLIER_PAIRS and the q_proj
    rows of the query heads reading that KV head divided by them. RoPE
    rotates each pair as a plane, which commutes with scaling the plane, so
    q.k is unchanged: the unquantized model is the same function as the
    control, only the stored keys differ.
    """
    from mlx_lm.models import llama

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=512, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(args)
    model.set_dtype(mx.float32)
    D, n_kv, rep = 64, 2, 2
    for layer in model.model.layers:
        a = layer.self_attn
        q_scale = mx.ones((4 * D,)) * 3.0
        k_scale = mx.ones((n_kv * D,)) * 3.0
        if outliers:
            q_scale, k_scale = q_scale.tolist(), k_scale.tolist()
            for h in range(n_kv):
                for i, s in OUTLIER_PAIRS.items():
                    for c in (i, i + D // 2):
                        k_scale[h * D + c] *= s
                        for r in range(rep):
                            q_scale[(h * rep + r) * D + c] /= s
            q_scale, k_scale = mx.array(q_scale), mx.array(k_scale)
        a.q_proj.weight = a.q_proj.weight * q_scale[:, None]
        a.k_proj.weight = a.k_proj.weight * k_scale[:, None]
    mx.eval(model.parameters())
    attention.install()
    return model


class _Recorder:
    """Records every attention call's (queries, keys, values, mask, scale)."""

    def __init__(self):
        self.calls = []

    def __call__(self, queries, keys, values, cache, scale, mask, sinks=None):
        self.calls.append((queries, keys, values, mask, scale))
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def record_attention(model, tokens: list[int], chunk: int) -> list:
    """Run `tokens` through unquantized caches chunk by chunk, recording attention inputs."""
    from mlx_lm.models import cache as mlx_cache
    from mlx_lm.models import llama

    rec = _Recorder()
    saved = llama.scaled_dot_product_attention
    llama.scaled_dot_product_attention = rec
    try:
        cache = mlx_cache.make_prompt_cache(model)
        ids = mx.array(tokens)[None]
        for s in range(0, len(tokens), chunk):
            mx.eval(model(ids[:, s : s + chunk], cache=cache))
            mx.eval([c[:3] for c in rec.calls])
    finally:
        llama.scaled_dot_product_attention = saved
    return rec.calls


def attention_error(calls: list, key_spec: QuantSpec, value_spec: QuantSpec) -> float:
    """Relative Frobenius error of attention outputs over all recorded calls."""
    num = den = 0.0
    for q, k, v, mask, scale in calls:
        ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        kq = Store.encode(k, key_spec).fetch()
        vq = Store.encode(v, value_spec).fetch()
        out = attention.quantized_attention(q, kq, vq, scale, mask)
        num += mx.sum((out - ref) ** 2).item()
        den += mx.sum(ref**2).item()
    return math.sqrt(num / den)


def key_outlier_ratio(calls: list) -> float:
    """Largest per-channel RMS of the keys over the median channel RMS."""
    ratios = []
    for _, k, _, _, _ in calls[-4:]:
        rms = mx.sqrt(mx.mean(k.astype(mx.float32) ** 2, axis=(0, 2)))  # (heads, dim)
        ratios.append((rms.max(axis=-1) / mx.median(rms, axis=-1)).max().item())
    return max(ratios)


def outlier_settings() -> list[tuple[str, str, KVConfig]]:
    out = []
    for bits in (4, 3):
        for which in ("keys", "values", "both"):
            for rot in ("none", "hadamard"):
                kb = bits if which in ("keys", "both") else None
                vb = bits if which in ("values", "both") else None
                out.append((which, rot, KVConfig(key_bits=kb, value_bits=vb, rotation=rot)))
    return out


def run_outlier(args) -> dict:
    mx.random.seed(1)
    tokens = mx.random.randint(0, 512, (args.outlier_tokens,)).tolist()
    settings = outlier_settings()
    sections = {}
    for name, outliers in (("outlier", True), ("control", False)):
        model = outlier_model(outliers)
        calls = record_attention(model, tokens[: args.context], args.chunk)
        ratio = key_outlier_ratio(calls)
        errs = [attention_error(calls, c.key_spec, c.value_spec) for _, _, c in settings]
        evals = evaluate_many(
            model, tokens, [c for _, _, c in settings], context=args.context, chunk=args.chunk,
            windows=args.windows, progress=True,
        )  # fmt: skip
        rows = []
        for (which, rot, c), err, r in zip(settings, errs, evals, strict=True):
            rows.append({"quantized": which, "rotation": rot, "bits": c.key_bits or c.value_bits,
                         "attn_rel_err": err, **r})  # fmt: skip
        sections[name] = {"key_outlier_ratio": ratio, "rows": rows}
        print(f"{name}: key channel RMS max/median {ratio:.1f}", file=sys.stderr)
    return sections


def outlier_table(sections: dict) -> str:
    """Rows: model, bits, which tensor is quantized; columns: without / with rotation."""
    lines = [
        "| model | bits | quantized | attn. output rel. error, no rotation | with rotation "
        "| mean KL (nats), no rotation | with rotation |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for name, sec in sections.items():
        label = f"{name} (key channel RMS max/median {sec['key_outlier_ratio']:.1f}x)"
        rows = {(r["bits"], r["quantized"], r["rotation"]): r for r in sec["rows"]}
        for bits, which, _ in rows:
            if _ != "none":
                continue
            plain, rot = rows[(bits, which, "none")], rows[(bits, which, "hadamard")]
            lines.append(
                f"| {label} | {bits} | {which} | {plain['attn_rel_err']:.3f} | "
                f"{rot['attn_rel_err']:.3f} | {plain['kl_mean']:.3f} | {rot['kl_mean']:.3f} |"
            )
    return "\n".join(lines)


# -- writing ----------------------------------------------------------------------------------
def write_section(name: str, body: str, command: str) -> None:
    text = DOC.read_text() if DOC.exists() else "# Output quality under KV quantization\n"
    block = f"<!-- BEGIN {name} -->\nRegenerate with `{command}`.\n\n{body}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {name} -->.*?<!-- END {name} -->", re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    DOC.write_text(text)


def save_raw(key: str, value) -> None:
    raw = json.loads(RAW.read_text()) if RAW.exists() else {}
    raw[key] = value
    RAW.write_text(json.dumps(raw, indent=1) + "\n")


def demo_section(data: dict) -> str:
    r0 = data["results"][0]
    head = (
        f"Demo model, {r0['windows']} windows x {r0['context']} tokens of the held-out text, "
        f"prefill chunks of {r0['chunk']}, {r0['tokens_scored']} tokens scored; unquantized "
        f"perplexity {r0['ppl_base']:.4f}.\n\n"
    )
    return head + format_table(data["results"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("demo", "outlier"), default=None)
    p.add_argument("--model", default=None, help="default: the embedded demo model")
    p.add_argument("--text", type=Path, default=None)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--outlier-tokens", type=int, default=4096)
    p.add_argument(
        "--render", action="store_true", help="rewrite the tables from docs/quality.json only"
    )
    args = p.parse_args(argv)
    raw = json.loads(RAW.read_text()) if args.render and RAW.exists() else {}
    for name in ("demo", "outlier"):
        if args.only not in (None, name):
            continue
        if args.render:
            if name not in raw:
                continue
            data, cmd = raw[name]["data"], raw[name]["command"]
        else:
            cmd = (
                f"python scripts/quality_tables.py --only {name} --context {args.context} "
                f"--chunk {args.chunk} --windows {args.windows}"
            )
            data = run_outlier(args) if name == "outlier" else run_demo(args)
            save_raw(name, {"command": cmd, "data": data})
        body = outlier_table(data) if name == "outlier" else demo_section(data)
        write_section(name, body, cmd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
