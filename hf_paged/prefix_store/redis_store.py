"""A prefix store on a Redis server: one binary value per entry, expired by the server's own LRU.

Keys: ``hf_paged:v<STORE_FORMAT>:<namespace>:<hex hash of the entry's last page>``; values: the entry's
safetensors bytes (`hf_paged.prefix_store.entry`), metadata and checksum included. Writes use ``SET NX``
(two writers of one key both succeed, one value stays). Entries expire only by the server's memory
policy: configure ``maxmemory <bytes>`` and ``maxmemory-policy allkeys-lru`` (a warning says so when the
server is set otherwise). A Redis reachable by others must be trusted like the store folder: its values
become the model's keys and values.

Invariant: after construction no call raises for a server fault. A lost connection or a time-out makes
every call a miss (or a skipped write) for ``retry_seconds``, with one warning; then the server is tried
again. A value that fails verification is skipped, counted, warned about once and deleted.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Iterator, Sequence

from .base import RunStore
from .errors import BadEntry, StoreUnavailable
from .layout import STORE_FORMAT, PageLayout

READ_BATCH = 16  # entries fetched per round trip


def redacted(url: str) -> str:
    """``url`` without its password."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class RedisStore(RunStore):
    """Entries as values on the Redis server at ``url`` (``redis://host:port/db``, ``rediss://``, ``unix://``)."""

    def __init__(self, url: str, *, socket_timeout: float = 5.0, retry_seconds: float = 30.0):
        super().__init__(redacted(url))
        try:
            import redis
        except ImportError:
            raise StoreUnavailable(
                "the Redis prefix store needs the redis client: pip install 'hf_paged[store]'") from None
        self._lost_errors = (redis.ConnectionError, redis.TimeoutError)
        self._redis_error = redis.RedisError
        self.retry_seconds = retry_seconds
        self._down_until = 0.0
        try:
            self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout,
                                                socket_connect_timeout=socket_timeout)
        except ValueError as error:
            raise ValueError(
                f"cannot use the Redis URI {self.name!r}: {error}. Expected redis://host:port/db") from None
        try:
            self._client.ping()
        except redis.RedisError as error:
            self._client.close()
            raise StoreUnavailable(
                f"cannot reach the Redis prefix store at {self.name} ({error}). Start a server (e.g. redis-server "
                "--port 6379 --maxmemory 4gb --maxmemory-policy allkeys-lru) or fix the URI; "
                "open_store(uri, best_effort=True) continues without a store instead.") from None
        self._check_memory_policy()

    def _check_memory_policy(self) -> None:
        try:
            config = self._client.config_get("maxmemory*")
        except self._redis_error:
            return  # CONFIG may be disabled (managed servers): nothing to check
        policy, limit = config.get("maxmemory-policy", ""), int(config.get("maxmemory", 0) or 0)
        if not policy.startswith("allkeys-") or limit == 0:
            self.faults.warn("memory_policy", f"the server has maxmemory {limit} and maxmemory-policy {policy!r}, so "
                             "stored pages are never expired (writes fail once memory is full). Set a limit and an "
                             "LRU policy: CONFIG SET maxmemory 4gb; CONFIG SET maxmemory-policy allkeys-lru.")

    def _key(self, layout: PageLayout, key: bytes) -> str:
        return f"hf_paged:v{STORE_FORMAT}:{layout.namespace}:{key.hex()}"

    # ---------------------------------------------------------------- faults
    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _lost(self, error: Exception) -> None:
        self._down_until = time.monotonic() + self.retry_seconds
        self.counters.add(store_errors=1)
        self.faults.warn("unavailable", f"lost the server ({error}); continuing without the store, trying it again "
                         f"every {self.retry_seconds:g} s (failures are counted in store_errors).")

    # ---------------------------------------------------------------- primitives
    def _exists(self, layout: PageLayout, keys: Sequence[bytes]) -> list[bool]:
        if not self._up():
            return [False] * len(keys)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._key(layout, key))
        try:
            return [bool(found) for found in pipe.execute()]
        except self._redis_error as error:
            self._lost(error)
            return [False] * len(keys)

    def _read_many(self, layout: PageLayout, keys: Sequence[bytes]) -> Iterator[bytes | BadEntry | None]:
        for batch in range(0, len(keys), READ_BATCH):
            if not self._up():
                return
            pipe = self._client.pipeline(transaction=False)
            for key in keys[batch:batch + READ_BATCH]:
                pipe.get(self._key(layout, key))
            try:
                values = pipe.execute()
            except self._redis_error as error:
                self._lost(error)
                return
            yield from values

    def _write(self, layout: PageLayout, key: bytes, data: bytes) -> bool:
        if not self._up():
            return False
        try:
            return bool(self._client.set(self._key(layout, key), data, nx=True))
        except self._lost_errors as error:
            self._lost(error)
        except self._redis_error as error:  # e.g. OOM under maxmemory-policy noeviction
            self.counters.add(store_errors=1)
            self.faults.warn("write", f"a write failed ({error}); entries that fail are not stored (counted in "
                             "store_errors).")
        return False

    def _discard(self, layout: PageLayout, key: bytes) -> None:
        if self._up():
            try:
                self._client.delete(self._key(layout, key))
            except self._redis_error:
                pass  # the value is skipped on every read anyway

    def close(self) -> None:
        self._client.close()
