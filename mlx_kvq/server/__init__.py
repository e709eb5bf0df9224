"""HTTP layer of `mlx-kvq serve`: FastAPI app, OpenAI schemas and errors, startup."""
