"""Testing helpers for mlx_kvq (tiny random-weight model catalogue, ...)."""
