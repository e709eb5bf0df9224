"""HTTP only: the FastAPI app of `mlx-kvq serve`, its routes, schemas and errors."""
