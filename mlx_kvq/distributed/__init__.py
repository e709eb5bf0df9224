"""Quantized KV caches for models sharded over several machines (`mlx.launch`).

`mlx-kvq generate` and `mlx-kvq serve` detect a group of two or more ranks
(`mlx.launch`, or MLX_RANK + MLX_HOSTFILE) and then

- load with mlx-lm's `sharded_load`: tensor parallel by default, pipeline
  parallel with `--pipeline` (as mlx-lm's tools do);
- plan quantized caches on every rank for the heads (tensor) or layers
  (pipeline) that rank owns, and agree on the plan before anything runs: a
  rank that cannot honour it stops the whole group with its rank number;
- (serve) drive every rank's engine from rank 0, one control collective per
  step, gate readiness on the warm-up passing on every rank, and watch the
  group with a heartbeat side channel so that a dead rank turns `/health`
  into 503 with the reason and fails in-flight requests instead of hanging.

See docs/distributed.md.
"""

from .group import broadcast_json, gather_json, launched, rank, size, world
from .loading import PIPELINE, TENSOR, Shard, load_sharded, sync_seed
from .planning import gather_kv_bytes, plan_on_every_rank, rank_info, ranks_table

__all__ = [
    "PIPELINE",
    "TENSOR",
    "Shard",
    "broadcast_json",
    "gather_json",
    "gather_kv_bytes",
    "launched",
    "load_sharded",
    "plan_on_every_rank",
    "rank",
    "rank_info",
    "ranks_table",
    "size",
    "sync_seed",
    "world",
]
