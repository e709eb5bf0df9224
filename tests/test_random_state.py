"""mlx-kvq leaves the global random state to the user.

The native kernels' self-check runs lazily, on the first quantized attention
call; it must not reseed MLX's global generator (it did: a user who seeded
and then sampled got seed-0 draws).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvq_testing.server import python_path


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": python_path(dict(os.environ))}


SAMPLE = r"""
import json, sys
import mlx.core as mx
from mlx_lm import load
from mlx_lm.sample_utils import make_sampler
import mlx_kvq
from mlx_kvq import kernels

if sys.argv[2] == "checked-first":
    kernels.native_status()
checked_before = kernels._status is not None
model, tokenizer = load(sys.argv[1])
mx.random.seed(1234)
text = mlx_kvq.generate(model, tokenizer, "In the beginning", max_tokens=24,
                        sampler=make_sampler(temp=1.5), kv_bits=4)
after = mx.random.uniform(shape=(4,)).tolist()
print(json.dumps({"text": text, "after": after, "checked_before": checked_before,
                  "native": kernels.native_status().available}))
"""


def _sample(model_dir, order: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SAMPLE, str(model_dir), order],
        check=True, capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_seeded_sampling_is_the_same_whether_the_self_check_ran_before_or_during(tmp_path):
    """Seed, then sample with a temperature through `mlx_kvq.generate`: the
    draws are the same in a process whose native self-check ran before the
    seed and in one where it runs inside the generation."""
    from kvq_testing.tiny import save_tiny_model

    path = save_tiny_model(tmp_path / "llama", "llama")
    during = _sample(path, "during")
    before = _sample(path, "checked-first")
    assert before["checked_before"] and not during["checked_before"]
    assert during["native"] == before["native"]
    assert during["text"] and len(set(during["text"])) > 3, during
    assert during == {**before, "checked_before": False}


def test_self_check_draws_nothing_from_the_global_generator():
    """The global generator's next draw is the same with and without the self-check."""
    code = (
        "import json, mlx.core as mx\n"
        "from mlx_kvq import kernels\n"
        "mx.random.seed(7); a = mx.random.uniform(shape=(3,)).tolist()\n"
        "mx.random.seed(7); kernels.native_status(); b = mx.random.uniform(shape=(3,)).tolist()\n"
        "print(json.dumps([a, b, kernels.native_status().available]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True,
        env=subprocess_env(), timeout=120,
    )  # fmt: skip
    a, b, native = json.loads(out.stdout.strip().splitlines()[-1])
    assert a == b, (a, b, native)
