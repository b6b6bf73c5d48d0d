"""Where batchq keeps files it builds once and reuses: dequantised GGUF checkpoints, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$BATCHQ_CACHE_DIR, else ~/.cache/batchq."""
    return Path(os.environ.get("BATCHQ_CACHE_DIR") or Path.home() / ".cache" / "batchq")
