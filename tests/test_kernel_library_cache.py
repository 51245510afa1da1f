"""The private cache of compiled kernel libraries (issue 11, items 1 and 2; issue 30, item 8): no foreign,
planted, swapped or damaged library is ever loaded, and loading never crashes (each case runs in a fresh
interpreter, `subprocess_checks.run_python`; a rebuild copies the kernel the real compiler built once,
`conftest.replayed_kernel_build`)."""

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


@pytest.fixture(autouse=True)
def replayed_builds(monkeypatch, replayed_kernel_build):
    """Every kernel (re)build here copies the library the real compiler built once (`conftest.built_kernel`)."""
    monkeypatch.setenv("CC", replayed_kernel_build["CC"])


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


# ----------------------------------------------------------- issue 30, item 8: a shared cache folder, records, handles
@needs_cc
@pytest.mark.parametrize("mode,trusted", [(0o777, False), (0o770, False), (0o1777, True), (0o755, True)])
def test_a_cache_folder_others_can_write_is_refused_with_a_warning(tmp_path, mode, trusted):
    """$HF_PAGED_CACHE_DIR writable by others (not sticky): they could swap its kernels/ folder for their own, so
    the kernel is built into a private folder, with a warning; a sticky or private folder is used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(shared))
    assert "REASON None" in out.stdout
    built_there = list((shared / "kernels").glob("cpu_paged_attention-*.so"))
    if trusted:
        assert len(built_there) == 1 and "not using the kernel cache" not in out.stderr
    else:
        assert not built_there, "the kernel was built into a folder others can swap"
        assert "not using the kernel cache" in out.stderr and f"{shared}, above" in out.stderr
        assert "writable by other users and not sticky" in out.stderr


@needs_cc
@pytest.mark.parametrize("record", ["a link to a true record", "a huge file", "a fifo"])
def test_a_checksum_record_that_is_not_a_small_regular_file_is_refused(tmp_path, built_kernel, record):
    """The record is opened without following links or blocking, and read only when it is small: the library is
    rebuilt, never loaded on the word of a link, and loading neither hangs nor reads a terabyte."""
    target = _plant(tmp_path / "cache", built_kernel, built_kernel)
    sidecar = target.with_name(target.name + ".sha256")
    true_record = built_kernel.with_name(built_kernel.name + ".sha256")
    if record == "a link to a true record":
        shutil.copy(true_record, tmp_path / "record")
        sidecar.symlink_to(tmp_path / "record")
    elif record == "a huge file":
        with open(sidecar, "wb") as f:
            f.write(true_record.read_bytes())
            f.truncate(2**40)  # sparse: a terabyte that takes no room
    else:
        os.mkfifo(sidecar)
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"))
    assert "REASON None" in out.stdout and "rebuilding the CPU kernel" in out.stderr
    assert "checksum record" in out.stderr
    assert not sidecar.is_symlink() and sidecar.stat().st_size < 200  # rebuilt: a fresh record


@needs_cc
def test_a_file_without_the_elf_magic_is_rejected_before_dlopen(tmp_path, built_kernel):
    """A non-ELF file with a record of its own (so only the magic check stands): rejected and rebuilt, never
    handed to dlopen (where it would be an unusable library, not a rebuilt one)."""
    code = """
        import os
        from pathlib import Path
        from hf_paged.kernels import library_cache
        target = Path(os.environ["TARGET"])
        target.parent.mkdir(mode=0o700, parents=True)
        fake = target.parent / "fake.so"
        fake.write_bytes(b"MZ" + b"\\0" * 4096)
        library_cache.publish(fake, target)
    """
    target = tmp_path / "cache" / "kernels" / built_kernel.name
    run_python(code, TARGET=str(target))
    out = run_python(LOAD_KERNEL, HF_PAGED_CACHE_DIR=str(tmp_path / "cache"))
    assert "REASON None" in out.stdout and "is not an ELF shared library" in out.stderr
    assert target.read_bytes()[:4] == b"\x7fELF"


@needs_cc
def test_two_different_libraries_loaded_in_one_process_get_their_own_handles(tmp_path):
    """dlopen knows a library by its name: /proc/self/fd/<n> of a closed descriptor, reused for the second library,
    returned the first one's handle."""
    code = """
        import os, subprocess
        from pathlib import Path
        from hf_paged.kernels import library_cache
        folder = Path(os.environ["FOLDER"])
        folder.mkdir(mode=0o700)
        for n in (1, 2):
            source = folder / f"lib{n}.c"
            source.write_text(f"int which(void) {{ return {n}; }}\\n")
            subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / f"built{n}.so"), str(source)], check=True)
            library_cache.publish(folder / f"built{n}.so", folder / f"lib{n}.so")
        first = library_cache.load(folder / "lib1.so", ("which",))
        second = library_cache.load(folder / "lib2.so", ("which",))
        again = library_cache.load(folder / "lib1.so", ("which",))
        print("WHICH", first.which(), second.which(), again.which())
    """
    out = run_python(code, FOLDER=str(tmp_path / "libs"))
    assert "WHICH 1 2 1" in out.stdout
