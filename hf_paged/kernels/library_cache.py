"""A private cache of compiled libraries: only a library this user built is ever loaded.

Invariants (what torch's ``cpp_extension`` and Triton's file cache do, plus ownership checks):
- libraries live in a private folder (`hf_paged.paths.private_folder`: owned by this user, writable by
  nobody else, below folders nobody else can swap it in; created ``0700``); a folder that is not (a
  shared ``$HF_PAGED_CACHE_DIR``, say) is refused, and the caller gets a fresh private folder
  (``tempfile.mkdtemp``) and the reason;
- a library is published atomically (written beside its target, then ``os.replace``), followed by
  a sidecar ``<name>.sha256`` recording its size and SHA-256;
- before ``dlopen`` a file must be owned by this user, writable by nobody else, a regular file,
  start with the ELF magic and match its sidecar (a regular file of this user's, read without following
  links, at most `RECORD_LIMIT` bytes). It is read and loaded through one open file descriptor, so it
  cannot be swapped between the check and the load; the descriptor of a loaded library stays open (its
  ``/proc/self/fd`` name must not be reused for another library: dlopen would return this one). A
  truncated, damaged or planted file is therefore never mapped (mapping a truncated library is a
  ``SIGBUS``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

from ..paths import UntrustedFile, cache_dir, private_folder, read_trusted, unsafe_reason

ELF_MAGIC = b"\x7fELF"
RECORD_LIMIT = 256  # bytes: a record is one line, "<sha256 hex> <size>"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_record(path: Path) -> str:
    """The checksum record of the library at ``path``: a regular file of this user's, read without following a
    symbolic link or blocking, and at most `RECORD_LIMIT` bytes; raises `Rejected` otherwise."""
    record = _sidecar(path)
    try:
        fd = os.open(record, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        raise Rejected(f"{path} has no readable checksum record ({record.name}, a regular file)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > RECORD_LIMIT:
            raise Rejected(f"{record} is not a checksum record (a regular file of at most {RECORD_LIMIT} bytes)")
        reason = unsafe_reason(record, st)
        if reason:
            raise Rejected(reason)
        return f.read(RECORD_LIMIT + 1).decode("ascii", errors="replace")


def _digest(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()} {len(data)}\n"


def publish(built: Path, target: Path) -> None:
    """Move the freshly built library ``built`` to ``target`` (same folder) and record its checksum."""
    data = built.read_bytes()
    os.chmod(built, 0o700)
    os.replace(built, target)
    with tempfile.NamedTemporaryFile("w", dir=target.parent, delete=False, suffix=".tmp") as tmp:
        tmp.write(_digest(data))
    os.replace(tmp.name, _sidecar(target))


class Rejected(Exception):
    """The file was not loaded (missing, damaged, foreign): rebuilding it is safe."""


class Unusable(Exception):
    """The file passed every check and was loaded, but cannot serve (this process keeps it mapped)."""


def load(path: Path, symbols: tuple[str, ...]) -> ctypes.CDLL:
    """The library at ``path`` if it passes every check and exports ``symbols``.

    Raises `Rejected` (never loaded) or `Unusable` (loaded but unfit), saying why.
    """
    try:
        fd, data = read_trusted(path)
    except FileNotFoundError:
        raise Rejected(f"{path} does not exist") from None
    except (UntrustedFile, OSError) as error:
        raise Rejected(str(error)) from None
    try:
        if not data.startswith(ELF_MAGIC):
            raise Rejected(f"{path} is not an ELF shared library")
        if _read_record(path) != _digest(data):
            raise Rejected(f"{path} does not match its recorded checksum and size (damaged or replaced)")
        proc_path = f"/proc/self/fd/{fd}"  # load the very file that was checked
        by_descriptor = os.path.exists(proc_path)
        try:
            library = ctypes.CDLL(proc_path if by_descriptor else str(path))
        except OSError as error:
            raise Unusable(f"{path} cannot be loaded ({error})") from None
        if by_descriptor:  # dlopen knows a library by its name: the name of a closed descriptor would, reused,
            fd = None      # get the next library opened there this one's handle. It stays open for good.
    finally:
        if fd is not None:
            os.close(fd)
    missing = [name for name in symbols if not hasattr(library, name)]
    if missing:
        raise Unusable(f"{path} lacks the symbols {missing}")
    return library


# ------------------------------------------------------------------------------------------ building
def _cpu_signature() -> str:
    """The CPU's model and feature flags: ``-march=native`` code is only valid on the same kind of CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags", "Features"))}))
    except OSError:
        return platform.processor() or platform.machine()


def compiled_library(source: Path, flags: list[str], symbols: tuple[str, ...]) -> ctypes.CDLL | str:
    """The library built from the C file ``source`` with ``flags`` by the system compiler (``$CC``, default
    ``cc``) into this user's cache (``$HF_PAGED_CACHE_DIR/kernels``, keyed by the source, the compiler, the flags
    and the CPU), loaded after `load`'s checks; or a string saying why it cannot be built or loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        return f"no C compiler found (looked for {os.environ.get('CC', 'cc')!r}; set $CC)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        return f"the C compiler {compiler} does not run: {error}"
    key = hashlib.sha256("\0".join([source.read_text(), version, " ".join(flags), _cpu_signature()]).encode())
    try:
        folder, refused = private_folder(cache_dir() / "kernels", "hf_paged-kernels-")
    except OSError as error:
        return f"no private folder to build into ({error}); set HF_PAGED_CACHE_DIR to a folder only you can write"
    if refused:
        warnings.warn(f"hf_paged: not using the kernel cache because {refused}; building the CPU kernel into the "
                      f"private folder {folder} instead. Set HF_PAGED_CACHE_DIR to a folder only you can write.",
                      stacklevel=3)
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        return _load_or_build(compiler, source, flags, target, symbols)
    except Unusable as error:
        return f"{error}; delete it to rebuild"
    except (Rejected, RuntimeError) as error:
        return str(error)


def _load_or_build(compiler: str, source: Path, flags: list[str], target: Path,
                   symbols: tuple[str, ...]) -> ctypes.CDLL:
    """The verified library at ``target``; (re)built from ``source`` first when missing or rejected."""
    try:
        return load(target, symbols)
    except Rejected as error:
        if target.exists() or target.is_symlink():
            warnings.warn(f"hf_paged: rebuilding the CPU kernel: {error}.", stacklevel=4)
    try:
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then publish atomically
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *flags, "-o", str(built), str(source), "-lm"], capture_output=True,
                                    text=True)
            if result.returncode != 0:
                raise RuntimeError(f"building {source.name} with {compiler} failed:\n{result.stderr[-2000:]}")
            publish(built, target)
    except OSError as error:
        raise RuntimeError(f"cannot build into {target.parent} ({error}); set HF_PAGED_CACHE_DIR to a folder "
                           "only you can write") from None
    return load(target, symbols)
