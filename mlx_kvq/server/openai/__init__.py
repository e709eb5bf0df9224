"""OpenAI's chat completions and completions (and `/v1/models`): request
schemas, the translation into a chat job, handlers without HTTP, response
bodies, the model-variant fields (`variants.py`) and the routes."""
