"""A prefix store in a private folder: one safetensors file per entry.

Layout: ``<root>/v<STORE_FORMAT>/<namespace>/<key[:2]>/<key>.safetensors`` (``key``: the hex hash of
the entry's last page). Invariants:
- the root is owned by this user and writable by nobody else (the kernel cache's rule,
  `hf_paged.paths.unsafe_reason`), else `UnsafeStoreDirectory` at construction: files
  others could plant would become the model's keys and values. Folders below it are created ``0700``;
- a file is published whole: written to a temporary name in its folder, then renamed over its target,
  so readers and a concurrent writer of the same key see either no file or a complete one (two writers
  both succeed; the last rename wins, and both wrote the same pages);
- a file is read through one descriptor after checking that it is a regular file owned by this user and
  not writable by others; its checksum and metadata are verified (`decode_entry`); a bad file is
  skipped, counted and removed;
- the modification time is the LRU clock: set when written and when read. With ``max_bytes`` the store
  keeps the sizes of the files it knows (scanned at start, so an index survives a restart by being
  rebuilt from the files) and, when they exceed the cap, scans the folder and removes the least recently
  used files until 90% of the cap is left. Other processes' writes are seen at that scan;
- a failed write (full disk, read-only folder, file size limit) turns writing off for this store, with
  one warning; reads go on.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..paths import UntrustedFile, read_trusted, unsafe_reason
from .base import RunStore
from .errors import BadEntry, StoreUnavailable, UnsafeStoreDirectory
from .layout import STORE_FORMAT, PageLayout

SUFFIX = ".safetensors"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 600  # a temporary file this old belongs to a writer that died; scans remove it
LOW_WATER = 0.9  # eviction frees space down to this share of max_bytes


def checked_root(root: Path) -> Path:
    """``root`` (created ``0700`` when missing) if this user owns it and nobody else can write it."""
    try:
        if not root.exists():
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(root)
    except OSError as error:
        raise StoreUnavailable(f"the prefix store folder {root} cannot be created or read "
                               f"({error.strerror or error}); choose another folder") from None
    if not stat.S_ISDIR(st.st_mode):
        raise StoreUnavailable(f"the prefix store path {root} is not a folder; choose a folder")
    reason = unsafe_reason(root, st)
    if reason:
        raise UnsafeStoreDirectory(
            f"refusing the prefix store folder {root}: {reason}. Files that others can place there would be "
            f"loaded as the model's keys and values. Use a folder only you can write (chmod go-w {root}), or "
            "another folder.")
    return root


class DiskStore(RunStore):
    """Entries as files under a private folder ``root``; ``max_bytes`` caps their total size (LRU)."""

    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        root = Path(root).expanduser().absolute()
        super().__init__(f"file://{root}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive (or None for no cap), got {max_bytes}")
        self.root = checked_root(root)
        self.entries = root / f"v{STORE_FORMAT}"
        self.max_bytes = max_bytes
        self.writable = True
        self._lock = threading.Lock()
        self._clock = 0
        self._sizes: dict[str, int] = {}  # with max_bytes: entry files known to this store, and their sizes
        self._total = 0
        try:
            self.entries.mkdir(mode=0o700, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.entries, suffix=TEMP_SUFFIX)
            os.close(fd)
            os.unlink(probe)
        except OSError as error:
            self._stop_writing(error)
        if max_bytes is not None:
            self._index(self._scan())

    # ---------------------------------------------------------------- paths and clock
    def _path(self, layout: PageLayout, key: bytes) -> Path:
        name = key.hex()
        return self.entries / layout.namespace / name[:2] / (name + SUFFIX)

    def _now(self) -> int:
        """Nanoseconds for modification times: wall time, strictly increasing within this store."""
        with self._lock:
            self._clock = max(time.time_ns(), self._clock + 1)
            return self._clock

    # ---------------------------------------------------------------- primitives
    def _exists(self, layout: PageLayout, keys: Sequence[bytes]) -> list[bool]:
        return [self._path(layout, key).is_file() for key in keys]

    def _read_many(self, layout: PageLayout, keys: Sequence[bytes]) -> Iterator[bytes | BadEntry | None]:
        for key in keys:
            yield self._read(self._path(layout, key))

    def _read(self, path: Path) -> bytes | BadEntry | None:
        try:
            fd, data = read_trusted(path)
        except FileNotFoundError:
            return None
        except UntrustedFile as error:
            return BadEntry(str(error))
        except OSError as error:
            self.counters.add(store_errors=1)
            return BadEntry(f"{path} cannot be read ({error.strerror or error})")
        try:
            if self.writable:
                now = self._now()
                try:
                    os.utime(fd, ns=(now, now))  # the LRU clock
                except OSError:
                    pass  # a folder we may read but not change keeps its order
            return data
        finally:
            os.close(fd)

    def _write(self, layout: PageLayout, key: bytes, data: bytes) -> bool:
        if not self.writable:
            return False
        path = self._path(layout, key)
        temp = None
        try:
            for folder in (path.parent.parent, path.parent):
                folder.mkdir(mode=0o700, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            now = self._now()
            os.utime(temp, ns=(now, now))
            os.replace(temp, path)
        except OSError as error:
            if temp is not None:
                self._unlink(Path(temp))
            self._stop_writing(error)
            return False
        if self.max_bytes is not None:
            self._account(str(path), len(data))
        return True

    def _discard(self, layout: PageLayout, key: bytes) -> None:
        path = self._path(layout, key)
        self._unlink(path)
        with self._lock:
            self._total -= self._sizes.pop(str(path), 0)

    # ---------------------------------------------------------------- faults
    def _stop_writing(self, error: OSError) -> None:
        self.writable = False
        self.counters.add(store_errors=1)
        cause = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
                 errno.EROFS: "the file system is read-only", errno.EFBIG: "the file size limit is reached",
                 errno.EACCES: "the folder is not writable", errno.EPERM: "the folder is not writable",
                 }.get(error.errno, error.strerror or str(error))
        self.faults.warn("write", f"cannot write to {self.entries} ({cause}); the store is read-only for the rest of "
                         "this run (entries already stored are still read).")

    @staticmethod
    def _unlink(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass  # gone already, or not ours to remove: readers skip it anyway

    # ---------------------------------------------------------------- size cap
    def _scan(self) -> list[tuple[int, int, str]]:
        """(modification time, size, path) of every entry file; removes stale temporary files."""
        files, stale = [], time.time() - STALE_TEMP_SECONDS
        for folder, _, names in os.walk(self.entries):
            for name in names:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path, follow_symlinks=False)
                except OSError:
                    continue
                if name.endswith(TEMP_SUFFIX) and st.st_mtime < stale:
                    self._unlink(Path(path))
                elif name.endswith(SUFFIX):
                    files.append((st.st_mtime_ns, st.st_size, path))
        return files

    def _index(self, files: list[tuple[int, int, str]]) -> None:
        self._sizes = {path: size for _, size, path in files}
        self._total = sum(self._sizes.values())

    def _account(self, path: str, size: int) -> None:
        with self._lock:
            self._total += size - self._sizes.get(path, 0)
            self._sizes[path] = size
            if self._total <= self.max_bytes:
                return
            files = sorted(self._scan())
            total, evicted = sum(size for _, size, _ in files), 0
            for _, size, victim in files:
                if total <= self.max_bytes * LOW_WATER:
                    break
                self._unlink(Path(victim))
                total -= size
                evicted += 1
            self._index(files[evicted:])
        self.counters.add(store_evicted=evicted)
