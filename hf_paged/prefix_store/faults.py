"""Soft failures of a store: each kind is warned about once per store, and every occurrence is counted."""

from __future__ import annotations

import threading
import warnings


class Faults:
    """Warns once per kind of fault (``"bad_entry"``, ``"write"``, ``"unavailable"`` ...) for one store.

    Invariant: `warn` emits at most one warning per kind over the object's life, so a caller that
    keeps running without the store sees one line per problem, not one per page.
    """

    def __init__(self, store_name: str):
        self.store_name = store_name
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, kind: str, message: str) -> None:
        with self._lock:
            if kind in self._warned:
                return
            self._warned.add(kind)
        warnings.warn(f"hf_paged prefix store {self.store_name}: {message}", RuntimeWarning, stacklevel=3)
