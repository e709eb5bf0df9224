"""What a disk-tier file belongs to: the model, the KV setting, the layout, the versions.

A file is used only by a server whose fingerprint is the one it was written
with. The fingerprint covers what changes the bytes a cache holds for a
token sequence:

- the model: its type, its configuration, and every parameter's name,
  shape, dtype and values (all of a small one, evenly spaced samples of a
  large one: another fine-tune, adapter, quantization or compute dtype
  changes them);
- the KV setting as planned: every layer's kind, window, key and value
  specs (bits, group size, rotation), dims and hand-out, and the whole
  `KVConfig`;
- the layout: the block size, which slots page, the chunk size of the files;
- the versions: the record format, mlx-kvq's storage version and MLX's
  (whose quantization packs the bits).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_kvq.plan import KVPlan

from .records import FORMAT, host_array

STORAGE_VERSION = 1  # bump when a cache's stored form (Store parts, paging) changes
WHOLE = 1 << 16  # parameters with at most this many values are hashed whole
SAMPLES = 4096  # evenly spaced values hashed of a larger one


@dataclass(frozen=True)
class Fingerprint:
    """A digest (hex) and the description it was made from (written next to
    the files, so a person can tell what a directory holds)."""

    digest: str
    description: dict[str, Any]

    @property
    def root(self) -> bytes:
        """The start of every token chain digest under this fingerprint."""
        return bytes.fromhex(self.digest)


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    return str(value)


def weights_digest(model: Any) -> str:
    """A digest of every parameter's name, shape, dtype and values (sampled
    when large)."""
    h = hashlib.blake2b(digest_size=16)
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    for i in range(0, len(params), 64):
        batch = []
        for name, a in params[i : i + 64]:
            h.update(f"{name}:{a.dtype}:{tuple(a.shape)};".encode())
            flat = a.reshape(-1)
            if flat.size > WHOLE:
                flat = flat[:: flat.size // SAMPLES][:SAMPLES]
            batch.append(mx.contiguous(flat))
        mx.eval(batch)
        for flat in batch:
            h.update(host_array(flat).tobytes())
    return h.hexdigest()


def fingerprint(
    model: Any, plan: KVPlan, block_size: int | None, paged: frozenset, chunk_tokens: int
) -> Fingerprint:
    """The fingerprint of this model under this plan and layout."""
    plan_facts = {k: v for k, v in plan.to_dict().items() if k not in ("notes", "summary")}
    args = getattr(model, "args", None)
    description = {
        "model_type": plan.model_type,
        "model_config": json.loads(json.dumps(args, default=_jsonable)) if args else None,
        "weights": weights_digest(model),
        "plan": plan_facts,
        "layout": {
            "block_size": block_size,
            "paged_slots": sorted([list(k) for k in paged], key=lambda k: (k[0], k[1] or 0)),
            "chunk_tokens": chunk_tokens,
        },
        "versions": {"format": FORMAT, "storage": STORAGE_VERSION, "mlx": mx.__version__},
    }
    text = json.dumps(description, sort_keys=True, default=str)
    return Fingerprint(hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), description)


__all__ = ["STORAGE_VERSION", "Fingerprint", "fingerprint", "weights_digest"]
