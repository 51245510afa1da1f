"""The store protocol that the caches call, and the logic every backend shares.

A sequence's full pages are stored in *entries*: runs of ``layout.pages_per_entry`` consecutive pages
starting at multiples of it, plus a shorter last run where a sequence ends. An entry is keyed by the
chained hash of its last page, which names the whole prefix up to it. Lookups therefore walk a
prefix entry by entry: at page ``p`` (a multiple of the run length) the full run's key is tried, then
shorter ones (a sequence that ended there); a shorter run ends the walk.

Backends supply four primitives on keys (``(layout, page hash)``): `_exists`, `_read_many`, `_write`
and `_discard`; they turn their own failures into soft results (absent, not written) with one warning.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .entry import decode_entry, encode_entry
from .errors import BadEntry
from .faults import Faults
from .layout import PageLayout
from .load_policy import LoadDecision, LoadPolicy
from .stats import StoreStats


@dataclass(frozen=True)
class PageRun:
    """Pages ``first .. first + len(hashes) - 1`` of a sequence: each tensor has ``len(hashes)`` as first dim."""
    first: int
    hashes: tuple[bytes, ...]
    tensors: dict[str, torch.Tensor]

    @property
    def pages(self) -> int:
        return len(self.hashes)


@runtime_checkable
class PrefixStore(Protocol):
    """What a cache calls. ``hashes`` are the chained hashes of a sequence's full pages from page 0 on
    (for `put`, from page ``first`` on); ``tensors`` map each layout tensor to ``[pages, *shape]``."""

    def put(self, layout: PageLayout, hashes: Sequence[bytes], tensors: Mapping[str, torch.Tensor],
            first: int = 0) -> int: ...

    def contains_prefix(self, layout: PageLayout, hashes: Sequence[bytes]) -> int: ...

    def get(self, layout: PageLayout, hashes: Sequence[bytes], first: int = 0) -> list[PageRun]: ...

    def decide_load(self, nbytes: int, tokens: int, prefill_tokens_per_s: float | None) -> LoadDecision: ...

    def stats(self) -> dict[str, float]: ...

    def close(self) -> None: ...


class RunStore(ABC):
    """`PrefixStore` over a backend's key primitives. Never raises for a backend fault: reads miss,
    writes are skipped, one warning per kind of fault; bad input from the caller raises ValueError."""

    def __init__(self, name: str):
        self.name = name
        self.counters = StoreStats()
        self.policy = LoadPolicy()
        self.faults = Faults(name)

    # ---------------------------------------------------------------- backend primitives
    @abstractmethod
    def _exists(self, layout: PageLayout, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether an entry is stored under it."""

    @abstractmethod
    def _read_many(self, layout: PageLayout, keys: Sequence[bytes]) -> Iterator[bytes | BadEntry | None]:
        """Per key in order: its bytes, None when absent, or a `BadEntry` the backend refused to read."""

    @abstractmethod
    def _write(self, layout: PageLayout, key: bytes, data: bytes) -> bool:
        """Store ``data`` under ``key`` unless it is there; True when this call wrote it."""

    @abstractmethod
    def _discard(self, layout: PageLayout, key: bytes) -> None:
        """Remove the entry under ``key`` (one that failed verification), if it can be removed."""

    # ---------------------------------------------------------------- protocol
    def put(self, layout: PageLayout, hashes: Sequence[bytes], tensors: Mapping[str, torch.Tensor],
            first: int = 0) -> int:
        """Store pages ``first ..`` (``hashes[i]`` is page ``first + i``); returns the pages written.

        Only entries that start at or after ``first`` can be formed: pass pages from
        ``layout.entry_start(first)`` on to store the run that holds page ``first``.
        """
        if first < 0:
            raise ValueError(f"first must be >= 0, got {first}")
        layout.check(tensors, len(hashes))
        runs = list(self._runs_from(layout, first, first + len(hashes)))
        keys = [hashes[end - 1 - first] for _, end in runs]
        present = self._exists(layout, keys) if keys else []
        written = 0
        for (start, end), key, there in zip(runs, keys, present):
            if there:
                continue
            part = slice(start - first, end - first)
            data = encode_entry(layout, start, hashes[part], {n: t[part] for n, t in tensors.items()})
            if self._write(layout, key, data):
                written += end - start
                self.counters.add(store_pages_written=end - start, store_bytes_written=len(data))
        return written

    def contains_prefix(self, layout: PageLayout, hashes: Sequence[bytes]) -> int:
        """How many leading pages of ``hashes`` the store holds (entries not yet verified; `get` verifies)."""
        found = sum(end - start for start, end in self._walk(layout, hashes))
        self.counters.add(store_hits=found, store_misses=len(hashes) - found)
        return found

    def get(self, layout: PageLayout, hashes: Sequence[bytes], first: int = 0) -> list[PageRun]:
        """The longest run of leading pages of ``hashes`` that the store holds and that verify; entries that end
        before page ``first`` (pages the caller holds) are not read."""
        started = time.perf_counter()
        runs = [(start, end) for start, end in self._walk(layout, hashes) if end > first]
        keys = [hashes[end - 1] for _, end in runs]
        loaded, nbytes = [], 0
        for (start, end), key, data in zip(runs, keys, self._read_many(layout, keys)):
            if data is None:  # removed since the walk (evicted by another process)
                break
            try:
                if isinstance(data, BadEntry):
                    raise data
                nbytes += len(data)
                tensors = decode_entry(layout, start, hashes[start:end], data)
            except BadEntry as error:
                self.counters.add(store_rejected=1)
                self.faults.warn("bad_entry", f"skipped a stored entry (pages {start}..{end - 1}): {error}. It was "
                                 "removed and its pages are recomputed; later bad entries are skipped silently and "
                                 "counted in store_rejected.")
                self._discard(layout, key)
                break
            loaded.append(PageRun(start, tuple(hashes[start:end]), tensors))
        seconds = time.perf_counter() - started
        self.policy.bandwidth.record(nbytes, seconds)
        self.counters.add(store_pages_read=sum(run.pages for run in loaded), store_bytes_read=nbytes,
                          store_load_seconds=seconds)
        return loaded

    def decide_load(self, nbytes: int, tokens: int, prefill_tokens_per_s: float | None) -> LoadDecision:
        """Whether to load ``nbytes`` of found pages rather than prefill their ``tokens`` (counts a skipped load)."""
        decision = self.policy.decide(nbytes, tokens, prefill_tokens_per_s)
        if not decision.load:
            self.counters.add(store_recomputed=1)
        return decision

    def stats(self) -> dict[str, float]:
        """The counters (`hf_paged.prefix_store.stats.COUNTERS`) and the measured read bandwidth (bytes/s)."""
        return {**self.counters.snapshot(), "store_read_bytes_per_s": self.policy.bandwidth.bytes_per_second}

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- runs
    @staticmethod
    def _runs_from(layout: PageLayout, first: int, stop: int) -> Iterator[tuple[int, int]]:
        """The entries (start, end) wholly inside pages ``first .. stop - 1`` of a sequence."""
        n = layout.pages_per_entry
        start = layout.entry_start(first)
        if start < first:
            start += n
        for start in range(start, stop, n):
            yield start, min(start + n, stop)

    def _walk(self, layout: PageLayout, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """The stored entries that cover the longest run of leading pages, in order."""
        present = self._exists(layout, hashes) if hashes else []
        n, walk, page = layout.pages_per_entry, [], 0
        while page < len(hashes):
            end = next((e for e in range(min(page + n, len(hashes)), page, -1) if present[e - 1]), None)
            if end is None:
                break
            walk.append((page, end))
            if end < page + n:  # a shorter run is where a stored sequence ended
                break
            page = end
        return walk
