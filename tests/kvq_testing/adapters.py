"""Tiny LoRA adapters, written the way `mlx_lm.lora` writes them.

`save_lora_adapter` loads a model directory, turns its last layers' linear
layers into LoRA layers with mlx-lm's own `linear_to_lora_layers` (the
model frozen first, as `mlx_lm.lora.train_model` does), gives the adapter
weights seeded non-zero values (a fresh LoRA's `lora_b` is zero, which
would change nothing), and saves the trainable parameters to
`adapters.safetensors` next to an `adapter_config.json` with the fields
`mlx_lm.tuner.utils.load_adapters` reads (`fine_tune_type`, `num_layers`,
`lora_parameters`), through mlx-lm's `save_config`.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm import load
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import save_config


def save_lora_adapter(
    model_path: str | Path,
    out: str | Path,
    *,
    num_layers: int = 2,
    rank: int = 4,
    scale: float = 20.0,
    seed: int = 0,
    keys: list[str] | None = None,
) -> Path:
    """Write a LoRA adapter for the model at `model_path` into `out`; returns `out`."""
    model, _ = load(str(model_path))
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": 0.0}
    if keys is not None:
        params["keys"] = keys
    linear_to_lora_layers(model, num_layers, params)
    key = mx.random.key(seed)

    def fill(path: str, x: mx.array) -> mx.array:
        nonlocal key
        if path.rsplit(".", 1)[-1] not in ("lora_a", "lora_b"):
            return x
        key, sub = mx.random.split(key)
        return mx.random.normal(x.shape, dtype=x.dtype, key=sub) * (x.shape[0] ** -0.5)

    model.update(tree_map_with_path(fill, model.trainable_parameters()))
    weights = dict(tree_flatten(model.trainable_parameters()))
    if not weights:
        raise ValueError(f"no LoRA layers were made in {model_path}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    save_config(
        {"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params},
        out / "adapter_config.json",
    )
    return out
