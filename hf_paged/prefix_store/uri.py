"""`open_store`: a store object from a URI (``file:///dir``, a plain path, ``redis://host:port/db``)."""

from __future__ import annotations

import os
import re
import urllib.parse
import warnings

from .base import PrefixStore
from .disk import DiskStore
from .errors import StoreUnavailable
from .redis_store import RedisStore, redacted
from .writer import BackgroundWriter

REDIS_SCHEMES = ("redis", "rediss", "unix")
SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"512M"``, ``"20GB"``, ``"1.5g"`` (binary units)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", str(size).lower())
    if not match:
        raise ValueError(f"cannot read the size {size!r}: give bytes or a number with K, M, G or T (e.g. 20G)")
    return int(float(match[1]) * SIZE_UNITS[match[2]])


def open_store(uri: str | os.PathLike | PrefixStore, *, max_bytes: int | str | None = None,
               background: bool = False, best_effort: bool = False) -> PrefixStore | None:
    """The prefix store at ``uri``: a folder (``file:///path/to/dir``, or a plain path) or a Redis server
    (``redis://host:port/db``). A store object is returned as it is.

    ``max_bytes`` caps a folder store (LRU eviction; also ``file:///dir?max_bytes=20G``); Redis is capped by
    the server's ``maxmemory``. ``background=True`` wraps the store in a `BackgroundWriter` (writes on a
    thread). An unknown scheme or a bad size raises ValueError; a store that cannot be opened (Redis
    unreachable, a folder that cannot be created or that others can write) raises `StoreUnavailable`,
    or, with ``best_effort=True``, warns and returns None: the caller then runs without a store.
    """
    if isinstance(uri, PrefixStore):
        return uri
    try:
        store = _open(os.fspath(uri), None if max_bytes is None else parse_size(max_bytes))
    except StoreUnavailable as error:
        if not best_effort:
            raise
        warnings.warn(f"hf_paged: continuing without a prefix store: {error}", RuntimeWarning, stacklevel=2)
        return None
    return BackgroundWriter(store) if background else store


def _open(uri: str, max_bytes: int | None) -> PrefixStore:
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.lower()
    if "://" not in uri:
        return DiskStore(uri, max_bytes)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ValueError(
                f"a file:// prefix store must be on this machine (file:///path), got host {parts.netloc!r}")
        query = urllib.parse.parse_qs(parts.query)
        unknown = set(query) - {"max_bytes"}
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)} in {uri!r}; a folder store takes ?max_bytes=SIZE")
        if "max_bytes" in query:
            max_bytes = parse_size(query["max_bytes"][-1])
        return DiskStore(urllib.parse.unquote(parts.path), max_bytes)
    if scheme in REDIS_SCHEMES:
        if max_bytes is not None:
            raise ValueError("max_bytes applies to folder stores; cap a Redis store with the server's maxmemory")
        return RedisStore(uri)
    raise ValueError(f"unknown prefix store URI scheme {scheme!r} in {redacted(uri)!r}: use file:///path/to/dir (or a "
                     "plain path) for a folder, or redis://host:port/db for a Redis server")
