"""The prompt cache's disk tier (`--prompt-cache-dir`), by job: `records.py`
(the file format: checked, written atomically), `fingerprint.py` (what a file
belongs to), `directory.py` (the directory, its cap and the index),
`writer.py` (the writer thread and its bounded queue), `entries.py` (an
entry's caches as tensors and back) and `tier.py` (the hooks: write
through, read back at admission)."""

from .records import RecordError, Skip
from .tier import DEFAULT_DISK_BYTES, DiskSettings, DiskTier, DiskTierStats, open_tier

__all__ = [
    "DEFAULT_DISK_BYTES",
    "DiskSettings",
    "DiskTier",
    "DiskTierStats",
    "RecordError",
    "Skip",
    "open_tier",
]
