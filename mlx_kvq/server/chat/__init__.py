"""What every API shares, without HTTP: the one chat request model (`job.py`),
its answer read back as parts (`answer.py`), and the `ChatService` that
renders prompts (`prompting.py`, `system_turns.py`, `template_args.py`),
runs them on the engine (`generation.py`) and splits the answer into
content, reasoning and tool calls (`output.py`, `tools.py`)."""
