"""The private cache of compiled kernel libraries (issue 11, items 1 and 2; issue 30, item 8): no foreign,
planted, swapped or damaged library is ever loaded, and loading never crashes (each case runs in a fresh
interpreter, `subprocess_checks.run_python`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from subprocess_checks import needs_cc, run_python


LOAD_KERNEL = textwrap.dedent("""
    import warnings
    warnings.simplefilter("always")
    from hf_paged.kernels import cpu_paged_attention as k
    print("REASON", k.unavailable_reason())
""")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("HF_PAGED_TEST_MARK"), "w");
    if (f) fclose(f);
}
int paged_attention_f32(void *a) { return 0; }
int paged_attention_bf16(void *a) { return 0; }
"""


@pytest.fixture(scope="module")
def built_kernel(tmp_path_factory) -> Path:
    """A kernel library built the normal way into a fresh cache folder (with its checksum record)."""
    home = tmp_path_factory.mktemp("built")
    run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(home))
    (library,) = (home / "kernels").glob("cpu_paged_attention-*.so")
    return library


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    """A library with the kernel's symbols whose constructor touches $HF_PAGED_TEST_MARK when loaded."""
    folder = tmp_path_factory.mktemp("planted")
    source = folder / "planted.c"
    source.write_text(PLANTED_C)
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(folder / "planted.so"), str(source)],
                   check=True)
    return folder / "planted.so"


def _plant(home: Path, built_kernel: Path, library: Path, folder_mode: int = 0o700) -> Path:
    kernels = home / "kernels"
    kernels.mkdir(parents=True)
    os.chmod(kernels, folder_mode)
    target = kernels / built_kernel.name
    shutil.copy(library, target)
    return target


@needs_cc
@pytest.mark.parametrize("folder_mode", [0o777, 0o770])
def test_planted_library_in_a_shared_folder_is_never_loaded(tmp_path, built_kernel, planted_library, folder_mode):
    _plant(tmp_path / "cache", built_kernel, planted_library, folder_mode)
    mark = tmp_path / "loaded"
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"), HF_PAGED_TEST_MARK=str(mark))
    assert not mark.exists(), "the planted library was loaded"
    assert "REASON None" in out.stdout  # the kernel was built into a private folder instead
    assert out.stderr.count("writable by other users") == 1 and "private folder" in out.stderr


@needs_cc
@pytest.mark.parametrize("tamper", ["no record", "forged record", "group-writable file", "foreign owner"])
def test_planted_library_in_a_private_folder_is_rebuilt(tmp_path, built_kernel, planted_library, tamper):
    target = _plant(tmp_path / "cache", built_kernel, planted_library)
    if tamper == "forged record":  # the genuine library's record next to a different file
        shutil.copy(built_kernel.with_name(built_kernel.name + ".sha256"), target.with_name(target.name + ".sha256"))
    elif tamper == "group-writable file":
        os.chmod(target, 0o775)
    elif tamper == "foreign owner":
        if os.getuid() != 0:
            pytest.skip("giving a file to another user needs root")
        os.chown(target, 65534, 65534)
    mark = tmp_path / "loaded"
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"), HF_PAGED_TEST_MARK=str(mark))
    assert not mark.exists(), "the planted library was loaded"
    assert "REASON None" in out.stdout and "rebuilding the CPU kernel" in out.stderr
    assert target.stat().st_uid == os.getuid() and target.read_bytes() != planted_library.read_bytes()


@needs_cc
def test_cache_folders_are_private(tmp_path, built_kernel):
    run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "new" / "cache"))
    assert (tmp_path / "new" / "cache" / "kernels").stat().st_mode & 0o777 == 0o700
    assert built_kernel.parent.stat().st_mode & 0o777 == 0o700


@needs_cc
@pytest.mark.parametrize("damage", ["truncated", "zero bytes", "not ELF"])
def test_damaged_library_is_rebuilt_without_a_crash(tmp_path, built_kernel, damage):
    target = _plant(tmp_path / "cache", built_kernel, built_kernel)
    shutil.copy(built_kernel.with_name(built_kernel.name + ".sha256"), target.with_name(target.name + ".sha256"))
    data = built_kernel.read_bytes()
    target.write_bytes({"truncated": data[: len(data) // 3], "zero bytes": b"", "not ELF": b"MZ" + data[2:]}[damage])
    out = run_python(LOAD_KERNEL + "import torch; from hf_paged.backends import resolve_backend\n"
                     "assert resolve_backend('auto', torch.device('cpu')) == 'cpu'\n",
                     HF_PAGED_CACHE_DIR=str(tmp_path / "cache"))
    assert "REASON None" in out.stdout and "rebuilding the CPU kernel" in out.stderr
    assert target.read_bytes() == data


@needs_cc
def test_library_without_the_kernel_symbols_falls_back_with_a_message(tmp_path, built_kernel):
    """A verified library that lacks the symbols: a reason, the torch path, no AttributeError."""
    code = """
        import os, subprocess, tempfile, warnings
        from pathlib import Path
        import torch
        from hf_paged.kernels import library_cache
        from hf_paged.backends import resolve_backend
        from hf_paged.kernels import cpu_paged_attention as k
        target = Path(os.environ["TARGET"])
        target.parent.mkdir(mode=0o700, parents=True)
        src = target.parent / "empty.c"
        src.write_text("int unrelated(void) { return 0; }\\n")
        built = target.parent / "empty.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(built), str(src)], check=True)
        library_cache.publish(built, target)
        reason = k.unavailable_reason()
        assert reason and "lacks the symbols" in reason, reason
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert resolve_backend("auto", torch.device("cpu")) == "torch"
        assert any("lacks the symbols" in str(w.message) for w in caught)
    """
    run_python(code, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"),
               TARGET=str(tmp_path / "cache" / "kernels" / built_kernel.name))
