"""The default KV setting of the server and the CLI, in one place.

Chosen from the quality table in docs/quality.md: the cheapest setting that
meets the 4-bit goal (relative perplexity change <= 0.5% on the demo model).
"""

from .config import KVConfig

DEFAULT_KV_CONFIG = KVConfig(bits=4, group_size=64, rotation="none")
