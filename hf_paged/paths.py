"""Where hf_paged keeps files between runs (converted model weights, compiled kernels), and whether a folder is
private enough to trust what it holds.

A file in a folder that another user can write (or rename, or replace) may be theirs: a planted kernel library
would run as this user, planted weights would compute the model. So every folder hf_paged reads such files from
passes `unsafe_folder_reason`: owned by this user and writable by nobody else, below folders that are owned by this
user or root and, when others may write them, sticky (as ``/tmp`` is: nobody renames or removes what is not
theirs).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """``$HF_PAGED_CACHE_DIR`` if set, else ``~/.cache/hf_paged``."""
    return Path(os.environ.get("HF_PAGED_CACHE_DIR") or Path.home() / ".cache" / "hf_paged").expanduser()


def unsafe_reason(path: Path, st: os.stat_result) -> str | None:
    """Why a file or folder with status ``st`` must not be trusted (another owner, writable by others), or None."""
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})"
    return None


class UntrustedFile(Exception):
    """A file `read_trusted` did not read, and why."""


def read_trusted(path: Path) -> tuple[int, bytes]:
    """``path``'s bytes, read when it is a regular file that `unsafe_reason` accepts (a link is never followed), and
    its descriptor, open, for the caller to use and close (the very file that was checked). Raises
    FileNotFoundError, `UntrustedFile` saying why it was not read, or OSError when reading failed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise
    except OSError as error:
        raise UntrustedFile(f"{path} cannot be opened ({error.strerror or error})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedFile(f"{path} is not a regular file")
        reason = unsafe_reason(path, st)
        if reason:
            raise UntrustedFile(reason)
        with os.fdopen(os.dup(fd), "rb") as f:
            return fd, f.read()
    except BaseException:
        os.close(fd)
        raise


def unsafe_folder_reason(folder: Path) -> str | None:
    """Why another user could place, swap or remove files in the existing ``folder``, or None when it is private
    (see the module docstring). The folders above it are checked as written and as symbolic links resolve."""
    folder = Path(folder).absolute()
    try:
        st = os.stat(folder)
        if not stat.S_ISDIR(st.st_mode):
            return f"{folder} is not a folder"
        reason = unsafe_reason(folder, st)
        if reason:
            return reason
        above = {*folder.parents, *folder.resolve().parents}
        if folder.is_symlink():
            above.add(folder)  # the link itself: whoever owns it decides where it leads
        for path in sorted(above, key=lambda p: len(p.parts)):
            st = os.lstat(path)
            if st.st_uid not in (os.getuid(), 0):
                return f"{path}, above {folder}, is owned by uid {st.st_uid}, neither this user nor root"
            if stat.S_ISDIR(st.st_mode) and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and \
                    not st.st_mode & stat.S_ISVTX:
                return (f"{path}, above {folder}, is writable by other users and not sticky (mode "
                        f"{stat.filemode(st.st_mode)}): they could replace {folder}")
    except OSError as error:
        return f"{folder} cannot be checked ({error.strerror or error})"
    return None


def private_folder(folder: Path, fallback_prefix: str) -> tuple[Path, str | None]:
    """``folder`` (created ``0700`` if missing) when it is private (`unsafe_folder_reason`), else a new private
    temporary folder (``tempfile.mkdtemp(prefix=fallback_prefix)``) and the reason ``folder`` was refused.

    Raises OSError when neither can be created.
    """
    try:
        Path(folder).mkdir(mode=0o700, parents=True, exist_ok=True)
        reason = unsafe_folder_reason(folder)
    except OSError as error:
        reason = f"{folder} cannot be created ({error.strerror or error})"
    if reason is None:
        return Path(folder), None
    return Path(tempfile.mkdtemp(prefix=fallback_prefix)), reason
