"""Compare a GGUF file's conversion with llama.cpp on the same file: token ids
of a corpus, and the logits of every position of a text.

Needs `llama-cpp-python` (it builds from its sdist in about 8 minutes; not a
dependency of mlx-kvq, run it from a separate environment that can import
both, e.g. PYTHONPATH pointing at this checkout's environment's site-packages).

    python scripts/llama_cpp_reference.py FILE.gguf --text /usr/share/common-licenses/GPL-3

Prints the token-id agreement on each text of the corpus and, over one window
of `--tokens` tokens, the largest logit difference (relative to the logits'
range), the mean KL divergence of llama.cpp's distribution from ours and the
top-1 agreement. llama.cpp multiplies with its quantized weights and quantizes
the activations to 8 bits on the CPU, so the two are close, not equal.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import numpy as np


def corpus(text: Path) -> dict[str, str]:
    return {
        text.name: text.read_text()[:20000],
        "json/decoder.py": inspect.getsource(json.decoder),
        "inspect.py": inspect.getsource(inspect)[:20000],
        "unicode": "naïve café — 東京 🙂\t\ttabs\n\n\n  two spaces, Ünïcödé, 123456789 <b>x</b>",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args()

    import llama_cpp
    import mlx.core as mx
    from mlx_lm import load

    import mlx_kvq
    from mlx_kvq.compute import prepare
    from mlx_kvq.from_gguf import converted

    mlx_kvq.use_fast_blas()
    directory, conversion, _ = converted(args.gguf)
    print(conversion.summary())
    model, tok = load(str(directory))
    prepare(model)
    ref = llama_cpp.Llama(
        str(args.gguf), n_ctx=args.tokens + 8, logits_all=True, verbose=False, n_threads=2
    )
    for name, text in corpus(args.text).items():
        ours = tok.encode(text, add_special_tokens=False)
        theirs = ref.tokenize(text.encode(), add_bos=False, special=False)
        same = ours == theirs
        first = next(
            (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None
        )
        print(
            f"tokens {name}: ours {len(ours)}, llama.cpp {len(theirs)}, equal {same}"
            + ("" if same else f" (first difference at {first})")
        )

    ids = tok.encode(args.text.read_text())[: args.tokens]
    ref.reset()
    ref.eval(ids)
    theirs = np.array(ref.scores[: len(ids)], dtype=np.float32)
    ours = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    span = float(theirs.max() - theirs.min())

    def logp(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = logp(theirs), logp(ours)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    top1 = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    print(
        f"logits over {len(ids)} positions: max |diff| {np.abs(theirs - ours).max():.4f} "
        f"({np.abs(theirs - ours).max() / span:.2e} of their range {span:.1f}), "
        f"mean KL {kl.mean():.2e} (max {kl.max():.2e}), top-1 agreement {top1:.2%}"
    )


if __name__ == "__main__":
    main()
