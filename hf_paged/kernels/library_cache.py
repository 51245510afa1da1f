"""A private cache of compiled libraries: only a library this user built is ever loaded.

Invariants (what torch's ``cpp_extension`` and Triton's file cache do, plus ownership checks):
- libraries live in a folder owned by this user and writable by nobody else (created ``0700``);
  a folder that is not (a shared ``$HF_PAGED_CACHE_DIR``, say) is refused, and the caller gets a
  fresh private folder (``tempfile.mkdtemp``) and the reason;
- a library is published atomically (written beside its target, then ``os.replace``), followed by
  a sidecar ``<name>.sha256`` recording its size and SHA-256;
- before ``dlopen`` a file must be owned by this user, writable by nobody else, a regular file,
  start with the ELF magic and match its sidecar. It is read and loaded through one open file
  descriptor, so it cannot be swapped between the check and the load. A truncated, damaged or
  planted file is therefore never mapped (mapping a truncated library is a ``SIGBUS``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import stat
import tempfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"


def unsafe_reason(path: Path, st: os.stat_result) -> str | None:
    """Why a file or folder with status ``st`` must not be trusted, or None."""
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


def private_folder(folder: Path) -> tuple[Path, str | None]:
    """``folder`` (created ``0700`` if missing) when it is safe, else a new private folder and why.

    Raises OSError when neither can be created.
    """
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(folder)
        reason = "not a folder" if not stat.S_ISDIR(st.st_mode) else unsafe_reason(folder, st)
    except OSError as error:
        reason = f"{folder} cannot be created ({error.strerror or error})"
    if reason is None:
        return folder, None
    return Path(tempfile.mkdtemp(prefix="hf_paged-kernels-")), reason


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


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
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise Rejected(f"{path} does not exist") from None
    except OSError as error:
        raise Rejected(f"{path} cannot be opened ({error.strerror or error})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise Rejected(f"{path} is not a regular file")
        reason = unsafe_reason(path, st)
        if reason:
            raise Rejected(reason)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read()
        if not data.startswith(ELF_MAGIC):
            raise Rejected(f"{path} is not an ELF shared library")
        try:
            recorded = _sidecar(path).read_text()
        except OSError:
            raise Rejected(f"{path} has no checksum record ({_sidecar(path).name})") from None
        if recorded != _digest(data):
            raise Rejected(f"{path} does not match its recorded checksum and size (damaged or replaced)")
        proc_path = f"/proc/self/fd/{fd}"  # load the very file that was checked
        try:
            library = ctypes.CDLL(proc_path if os.path.exists(proc_path) else str(path))
        except OSError as error:
            raise Unusable(f"{path} cannot be loaded ({error})") from None
    finally:
        os.close(fd)
    missing = [name for name in symbols if not hasattr(library, name)]
    if missing:
        raise Unusable(f"{path} lacks the symbols {missing}")
    return library
