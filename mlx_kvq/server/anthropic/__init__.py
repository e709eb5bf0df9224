"""Anthropic's Messages API, for Claude Code and the `anthropic` SDK: request
schemas, the translation into a chat job, handlers without HTTP, response
bodies and events, and the routes."""
