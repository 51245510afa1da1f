"""What every result records about the run that made it: package versions, load average, library source.

Imports nothing of hf_paged: scripts/kvpress_runner.py loads this file by path in kvpress's own environment.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path

PACKAGES = ("hf_paged", "torch", "transformers", "tokenizers", "datasets", "accelerate", "matplotlib")


def versions(packages=PACKAGES) -> dict:
    """Python, platform and the installed version of each of ``packages`` (None when it is not installed)."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in packages:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages, rounded to 2 decimals (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def idle_cores() -> int:
    """Cores minus the 1-minute load average, at least 1: how many torch threads pay on a shared machine (torch's
    default of a thread per core crawls when the cores are busy). scripts/compare.sh and test.sh choose the same."""
    load = load_average()
    return max(1, (os.cpu_count() or 1) - round(load[0] if load else 0))


def source_fingerprint(package) -> str:
    """sha256 (12 hex digits) of the package's .py and .c files as imported: which library code ran."""
    root = Path(package.__file__).parent
    h = hashlib.sha256()
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]
