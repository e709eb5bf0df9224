"""`import mlx_kvq` changes nothing it does not own.

Each case runs in a fresh interpreter (the suite itself runs on the fast
BLAS, tests/conftest.py): the same mlx-lm computation, with and without
`import mlx_kvq`, must give the same bits, and importing any module of the
package leaves mlx-lm's functions and module attributes as they were.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from mlx_kvq import blas

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux wheels only")

# mlx-lm's own test `test_gemma3n_kv_shared_layers_ignore_chunking` (tests/test_models.py
# of its 0.32.2 sdist), which changed outcome under `import mlx_kvq` when the import rebound
# MLX's BLAS, and a float32 llama's logits; printed as JSON for the parent to compare.
MODELS = r"""
import hashlib, json
import mlx.core as mx
from mlx_lm.models import gemma3n, llama

mx.random.seed(0)
args = gemma3n.ModelArgs(model_type="gemma3n", text_config={
    "model_type": "gemma3n", "hidden_size": 32, "num_hidden_layers": 4,
    "intermediate_size": 64, "num_attention_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "vocab_size": 64, "num_key_value_heads": 1, "num_kv_shared_layers": 2,
    "vocab_size_per_layer_input": 64, "sliding_window": 8, "max_position_embeddings": 128,
    "rope_local_base_freq": 1.0, "rope_theta": 1000.0, "final_logit_softcapping": 1.0,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "activation_sparsity_pattern": [0.0] * 4, "hidden_size_per_layer_input": 8,
    "altup_num_inputs": 1, "altup_coef_clip": 1.0, "altup_correct_scale": True,
    "altup_active_idx": 0, "laurel_rank": 4})
model = gemma3n.Model(args)
mx.eval(model.parameters())

def last_logits(chunks):
    cache = model.model.language_model.make_cache()
    for chunk in chunks:
        out = model(mx.array([chunk]), cache=cache)
    return out[:, -1]

whole = last_logits([[1, 2, 3, 4]])
chunked = last_logits([[1, 2], [3, 4]])

def digest(x):
    mx.eval(x)
    return hashlib.sha256(memoryview(x.astype(mx.float32))).hexdigest()

llama_model = llama.Model(llama.ModelArgs(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128))
mx.eval(llama_model.parameters())
tokens = mx.array([list(range(3, 40))])
print(json.dumps({
    "gemma3n_chunking_allclose": mx.allclose(whole, chunked).item(),
    "gemma3n_whole": digest(whole),
    "gemma3n_chunked": digest(chunked),
    "llama_logits": digest(llama_model(tokens)),
    "matmul": digest(mx.random.normal((64, 200), key=mx.random.key(1))
                     @ mx.random.normal((200, 48), key=mx.random.key(2))),
}))
"""


def _run(first: str, code: str = MODELS, env: dict[str, str] | None = None) -> dict:
    """What the code prints as JSON, its lines merged (`first` runs before it)."""
    environ = {k: v for k, v in os.environ.items() if k != blas.ENV}
    environ.update(env or {})
    out = subprocess.run(
        [sys.executable, "-c", f"{first}\n{code}"],
        check=True, capture_output=True, text=True, env=environ, timeout=300,
    )  # fmt: skip
    merged = {}
    for line in out.stdout.strip().splitlines():
        if line.startswith("{"):
            merged.update(json.loads(line))
    return merged


# Every mlx_kvq module imported one after another (entry points `__main__`
# aside, which run a command), each checked against what mlx-lm's modules
# held before: its entry points, its caches and attention, and model modules
# of each attention layout (the redirect rewrites the model modules already
# imported). Prints what changed, by the importing module.
EVERY_MODULE = r"""
import importlib, json, pkgutil, sys
for name in ("mlx_lm.generate", "mlx_lm.server", "mlx_lm.sample_utils", "mlx_lm.utils",
             "mlx_lm.models.base", "mlx_lm.models.cache", "mlx_lm.models.llama",
             "mlx_lm.models.gemma3_text", "mlx_lm.models.gemma3n", "mlx_lm.models.gpt_oss",
             "mlx_lm.models.deepseek_v41"):
    importlib.import_module(name)

def snapshot():
    out = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "mlx_lm" or name.startswith("mlx_lm.")):
            continue
        attrs = {k: id(v) for k, v in vars(module).items()}
        for k, v in vars(module).items():
            if isinstance(v, type) and v.__module__ == name:
                attrs.update({f"{k}.{m}": id(x) for m, x in vars(v).items()})
        out[name] = attrs
    return out

import mlx_kvq
before = snapshot()
changed = {}
names = [m.name for m in pkgutil.walk_packages(mlx_kvq.__path__, "mlx_kvq.")]
for name in [n for n in names if not n.endswith("__main__")]:
    importlib.import_module(name)
    after = snapshot()
    for mod, attrs in after.items():
        was = before.get(mod)
        if was is None:
            continue
        diff = sorted(k for k in set(was) | set(attrs) if was.get(k) != attrs.get(k))
        if diff:
            changed[name] = changed.get(name, []) + [f"{mod}: {d}" for d in diff]
    before = after
print(json.dumps({"modules": len(names), "changed": changed}))
"""

# Then what imports no longer do, the code paths that need it do: a plan
# redirects mlx-lm's attention, the first cache makes our classes loadable by
# name from mlx-lm prompt files.
PLANNING = r"""
import json
import mlx_lm.models.base as base, mlx_lm.models.cache as cache
from mlx_kvq import attention, plan
from mlx_kvq.caches import KVQFullCache
from mlx_kvq.config import QuantSpec
first = [base.scaled_dot_product_attention is attention.MLX_LM_ATTENTION,
         hasattr(cache, "KVQFullCache")]
plan.plan_kv({"model_type": "llama", "hidden_size": 16, "num_hidden_layers": 1,
              "intermediate_size": 32, "num_attention_heads": 2, "rms_norm_eps": 1e-5,
              "vocab_size": 16})
KVQFullCache(QuantSpec(4), QuantSpec(4))
then = [base.scaled_dot_product_attention is attention.scaled_dot_product_attention,
        cache.KVQFullCache is KVQFullCache]
print(json.dumps({"planning": {"first": first, "then": then}}))
"""


def test_importing_the_package_changes_nothing_of_mlx_lm():
    """Importing every module of the package leaves mlx-lm's functions and
    module attributes (and its classes') as they were, and mlx-lm computes the
    same bits with and without it (its gemma3n chunking test keeps its
    outcome, float32 logits keep every bit); the redirect and the cache
    classes' registration come with planning and making caches."""
    without = _run("")
    assert without["gemma3n_chunking_allclose"] is True, without
    out = _run(EVERY_MODULE, MODELS + PLANNING)
    assert out["modules"] > 90, out
    assert out["changed"] == {}, out["changed"]
    assert {k: out[k] for k in without} == without
    assert out["planning"] == {"first": [True, False], "then": [True, True]}


@linux
def test_import_leaves_the_blas_slots_as_linked():
    """After `import mlx_kvq` libmlx's cblas slots still hold what the loader
    bound; `use_fast_blas()` is what rebinds them."""
    code = (
        "from mlx_kvq import blas\n"
        "slots = blas._find_slots()\n"
        "before = {n: slots.current(n) == slots.linked[n] for n in blas.SYMBOLS}\n"
        "info = blas.blas_info().to_dict()\n"
        "fast = mlx_kvq.use_fast_blas().to_dict()\n"
        "import json; print(json.dumps({'as_linked': before, 'info': info, 'fast': fast}))\n"
    )
    out = _run("import mlx_kvq", code)
    assert out["as_linked"] == dict.fromkeys(blas.SYMBOLS, True), out
    assert out["info"]["binding"] == blas.BlasBinding.LINKED.value
    assert out["info"]["kind"] == blas.BlasKind.REFERENCE.value
    assert "use_fast_blas" in out["info"]["reason"]
    assert out["fast"]["kind"] == blas.BlasKind.OPENBLAS.value
    assert out["fast"]["binding"] == blas.BlasBinding.REBOUND.value


def test_digest_helper_sees_a_one_ulp_change():
    """The comparison above is bit for bit: one ulp in one element changes it."""
    import mlx.core as mx
    import numpy as np

    x = np.linspace(-1, 1, 64, dtype=np.float32)
    y = x.copy()
    y[7] = np.nextafter(y[7], np.float32(2))
    a = hashlib.sha256(memoryview(mx.array(x))).hexdigest()
    b = hashlib.sha256(memoryview(mx.array(y))).hexdigest()
    assert a != b
