"""Running crash-prone code (loading a library, kernels on bad indices) in a fresh interpreter that must exit
normally: a negative return code is a signal (SIGSEGV, SIGBUS)."""

from __future__ import annotations

import os
import shlex
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


def replaying_compiler(folder: Path, built_kernel: Path) -> Path:
    """A stand-in C compiler for tests of the kernel cache (not of the compiler): a build of the CPU kernel copies
    ``built_kernel``, the library the real compiler built once (2-3 minutes on two cores), to its ``-o`` path;
    ``--version`` and any other build run the real ``$CC``, so the cache's key and file name stay the real ones."""
    real = shutil.which(os.environ.get("CC", "cc"))
    script = folder / "replaying-cc"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        out=""; kernel=""; previous=""
        for arg in "$@"; do
          [ "$previous" = "-o" ] && out="$arg"
          case "$arg" in */cpu_paged_attention.c) kernel=1 ;; esac
          previous="$arg"
        done
        if [ -n "$kernel" ] && [ -n "$out" ]; then exec cp {shlex.quote(str(built_kernel))} "$out"; fi
        exec {shlex.quote(real)} "$@"
    """))
    script.chmod(0o755)
    return script
