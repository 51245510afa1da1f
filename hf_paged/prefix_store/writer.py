"""Writes off the critical path: a store whose `put` hands the pages to one background thread.

Invariants: at most ``max_pending`` puts wait in the queue (a full queue makes `put` wait, so memory
stays bounded and no write is dropped silently); `put` checks its input before queueing (bad input
raises in the caller, not in the thread); the tensors given to `put` belong to the writer from then on
(pass copies of pool pages, e.g. from ``index_select``); an error in a background write becomes one
warning and counts in ``store_errors``; `flush` returns once every queued put is done; `close` flushes,
stops the thread and closes the store. Pending writes are flushed at interpreter exit.
"""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Mapping, Sequence

import torch

from .base import PageRun, PrefixStore
from .layout import PageLayout
from .load_policy import LoadDecision

_STOP = object()


class BackgroundWriter:
    """A `PrefixStore` that forwards reads to ``store`` and runs its writes on a background thread."""

    def __init__(self, store: PrefixStore, max_pending: int = 16):
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.store = store
        self._queue: queue.Queue = queue.Queue(max_pending)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hf_paged-store-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def put(self, layout: PageLayout, hashes: Sequence[bytes], tensors: Mapping[str, torch.Tensor],
            first: int = 0) -> int:
        """Queue the pages for writing; returns how many were queued (they are written later, unless stored)."""
        if self._closed:
            raise RuntimeError("this BackgroundWriter is closed; open the store again to write")
        if first < 0:
            raise ValueError(f"first must be >= 0, got {first}")
        layout.check(tensors, len(hashes))
        self._queue.put((layout, list(hashes), dict(tensors), first))
        return len(hashes)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self.store.put(*item)
            except Exception as error:  # a write must never end the thread: later writes still run
                counters = getattr(self.store, "counters", None)
                if counters is not None:
                    counters.add(store_errors=1)
                faults = getattr(self.store, "faults", None)
                message = f"a background write failed ({type(error).__name__}: {error}); its pages are not stored"
                if faults is not None:
                    faults.warn("background_write", message + " (later failures are counted in store_errors).")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()

    def close(self) -> None:
        """Flush, stop the thread, close the store. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._queue.put(_STOP)
        self._thread.join()
        self.store.close()

    def contains_prefix(self, layout: PageLayout, hashes: Sequence[bytes]) -> int:
        return self.store.contains_prefix(layout, hashes)

    def get(self, layout: PageLayout, hashes: Sequence[bytes], first: int = 0) -> list[PageRun]:
        return self.store.get(layout, hashes, first)

    def decide_load(self, nbytes: int, tokens: int, prefill_tokens_per_s: float | None) -> LoadDecision:
        return self.store.decide_load(nbytes, tokens, prefill_tokens_per_s)

    def stats(self) -> dict[str, float]:
        return {**self.store.stats(), "store_pending_writes": self._queue.qsize()}

    def __enter__(self) -> "BackgroundWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
