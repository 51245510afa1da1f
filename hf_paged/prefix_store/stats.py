"""The counters of one store, shared by the threads that use it."""

from __future__ import annotations

import threading

COUNTERS = (
    "store_hits",           # pages found by lookups (`contains_prefix`): the leading pages a store holds
    "store_misses",         # pages looked up and not found (the rest of each lookup)
    "store_pages_read",     # pages read and verified (`get`)
    "store_pages_written",  # pages written (entries that were not there yet)
    "store_bytes_read",
    "store_bytes_written",
    "store_load_seconds",   # wall time spent in reads, verification included
    "store_recomputed",     # loads skipped (pages found, recomputed) because loading was estimated slower
    "store_rejected",       # entries skipped as truncated, corrupt or foreign (and removed)
    "store_errors",         # backend failures: I/O errors, a lost server, a failed write
    "store_evicted",        # entries this process removed to keep a disk store under its size cap
)


class StoreStats:
    """Counters named in `COUNTERS`; `add` and `snapshot` may be called from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = dict.fromkeys(COUNTERS, 0)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount  # KeyError for a misspelt counter

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)
