"""Running crash-prone code (loading a library, kernels on bad indices) in a fresh interpreter that must exit
normally: a negative return code is a signal (SIGSEGV, SIGBUS)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; it must end normally (no signal, exit status 0)."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env})
    assert result.returncode >= 0, f"killed by signal {-result.returncode}:\n{result.stderr[-3000:]}"
    assert result.returncode == 0, result.stderr[-3000:]
    return result
