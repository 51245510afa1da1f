"""Eviction policies: which of a row's live pages gives way when a bounded pool is full.

Order of what gives way (see `PageGroup.begin_step`): a free page, then the least recently
used cached (unreferenced) page, then, per policy, one of the row's own live pages:
- ``"lru"``: the page least recently *used*, where a page is used in a step when it received
  at least ``threshold`` of the step's attention mass in some head of some layer of its group;
- ``"fifo"``: the oldest unprotected page (StreamingLLM: attention sinks + a recent window);
- ``"error"``: nothing is evicted; `PagePoolExhausted` is raised.
The first ``sink_pages`` logical pages and the last ``recent_pages`` live pages (always
including the page being written) are never evicted. Evicted tokens are gone for every layer of
the group; the positions of the kept tokens never change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .block_manager import EVICTED
from .errors import CacheUsageError

logger = logging.getLogger(__name__)
POLICIES = ("lru", "fifo", "error")


@dataclass(frozen=True)
class EvictionPolicy:
    name: str = "lru"
    sink_pages: int = 1
    recent_pages: int = 1
    threshold: float = 0.5

    def __post_init__(self):
        if self.name not in POLICIES:
            raise CacheUsageError(f"eviction must be one of {POLICIES}, got {self.name!r}.")
        for field in ("sink_pages", "recent_pages"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise CacheUsageError(f"{field} must be a non-negative int, got {value!r}.")
        if not 0.0 <= self.threshold <= 1.0:
            raise CacheUsageError(f"lru_threshold must be a share of attention mass in [0, 1], got {self.threshold!r}.")

    @property
    def lossy(self) -> bool:
        return self.name != "error"

    @property
    def tracks_usage(self) -> bool:
        return self.name == "lru"

    def victim(self, row: list[int], first_page: int, last_used: dict[int, int]) -> int | None:
        """Index in ``row`` of the page to evict, or None when every live page is protected."""
        live = [i for i, page in enumerate(row) if page != EVICTED]
        recent = set(live[-max(self.recent_pages, 1):])
        candidates = [i for i in live if first_page + i >= self.sink_pages and i not in recent]
        if not candidates:
            return None
        if self.name == "fifo":
            return candidates[0]
        return min(candidates, key=lambda i: (last_used.get(row[i], -1), i))


_warned = False


def warn_first_eviction(policy: EvictionPolicy, max_pages: int) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning(
            "PagedCache(max_pages=%d) is full: evicting pages with policy %r (lossy: evicted tokens are no "
            "longer attended). Raise max_pages, or use eviction='error' to fail instead.", max_pages, policy.name)
