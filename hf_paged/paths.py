"""Where hf_paged keeps files between runs (converted model weights, compiled kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$HF_PAGED_CACHE_DIR`` if set, else ``~/.cache/hf_paged``."""
    return Path(os.environ.get("HF_PAGED_CACHE_DIR") or Path.home() / ".cache" / "hf_paged").expanduser()
