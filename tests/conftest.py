"""Test setup: Triton kernels run through the interpreter when there is no GPU; a one-thread fixture; the CPU kernel
built once for the tests of its build and cache."""

import os
from pathlib import Path

import pytest
import torch
from subprocess_checks import replaying_compiler, run_python

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run ~50x faster on one thread than on two busy cores (OpenMP wake-ups per op);
    modules of tiny-model tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def built_kernel(tmp_path_factory) -> Path:
    """The CPU kernel library built the normal way (by the real compiler) into a fresh cache folder, with its
    checksum record."""
    home = tmp_path_factory.mktemp("built")
    out = run_python("from hf_paged.kernels import cpu_paged_attention as k\nprint('REASON', k.unavailable_reason())",
                     HF_PAGED_CACHE_DIR=str(home))
    assert "REASON None" in out.stdout, out.stdout + out.stderr
    (library,) = (home / "kernels").glob("cpu_paged_attention-*.so")
    return library


@pytest.fixture(scope="session")
def replayed_kernel_build(tmp_path_factory, built_kernel) -> dict[str, str]:
    """The environment of a process whose kernel (re)builds copy `built_kernel` instead of compiling it again
    (`subprocess_checks.replaying_compiler`): the cache's checks and rebuilds run as they would, in seconds."""
    return {"CC": str(replaying_compiler(tmp_path_factory.mktemp("cc"), built_kernel))}
