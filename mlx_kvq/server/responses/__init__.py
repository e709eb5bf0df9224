"""OpenAI's Responses API, for Codex and the `openai` SDK: request schemas,
the translation into a chat job, handlers without HTTP, output items and
events, the store of responses (`store.py`), and the routes."""
