"""The default KV setting of the server and the CLI, in one place.

Chosen from the demo-model table in docs/quality.md: the cheapest setting
that meets the 4-bit goal (relative perplexity change <= 0.5%) is 4-bit keys
and 3-bit values with Hadamard rotation, 4.0 bits per element including
scales: +0.30% perplexity (plain K4/V4 at 4.5 bits: +0.23%; K4/V3 without
rotation: +0.84%, so rotation is on because it lowered the change here).
"""

from .config import KVConfig

DEFAULT_KV_CONFIG = KVConfig(bits=4, value_bits=3, group_size=64, rotation="hadamard")
