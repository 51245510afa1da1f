"""`ThreadOwner`: the one thread whose tokens a cache holds.

A cache serves one thread: rows of two threads' steps would mix. It is free when new, after
``reset()`` (by the thread that used it), as a fresh ``fork()`` and (a `RaggedCache`) when its
``generate_many`` run ended; the first thread that steps it claims it.
"""

from __future__ import annotations

import threading

from .errors import CacheUsageError


class ThreadOwner:
    """``kind``: the cache's class name; ``handover``: how to give the cache to another thread (error messages)."""

    def __init__(self, kind: str = "PagedCache", handover: str = (
            "Give each thread its own cache (cache.fork() shares the prompt's pages), or call cache.reset() in the "
            "thread that used it before handing it over.")):
        self.ident: int | None = None  # None: free
        self.kind, self.handover = kind, handover
        self._lock = threading.Lock()

    def claim(self) -> None:
        """Claim for this thread, or raise if another thread holds the cache's tokens."""
        me = threading.get_ident()
        if self.ident == me:
            return
        with self._lock:
            if self.ident is None:
                self.ident = me
                return
        raise CacheUsageError(
            f"this {self.kind} holds the tokens of thread {self.ident} and is now used by thread {me}: a cache "
            f"serves one thread (concurrent steps would mix their rows). {self.handover}")

    def is_mine_or_free(self) -> bool:
        return self.ident in (None, threading.get_ident())

    def release(self) -> None:
        self.ident = None
