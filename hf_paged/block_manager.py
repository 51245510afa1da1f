"""Page bookkeeping for one group of layers: free list, reference counts, LRU list of cached pages.

Invariants (checked by `check_invariants` and the property tests):
- every page id in ``range(num_pages)`` is in exactly one of: ``free`` (content invalid),
  ``cached`` (no reference, content valid, kept for prefix reuse), or referenced (``ref[p] > 0``);
- reference counts are never negative;
- a page has a content hash only while it is cached or referenced; ``hash_to_page`` and
  ``page_hash`` are inverse maps.
All operations are O(1) per page (``OrderedDict`` is a linked list), except `free_run`, which a
cache calls once per prefill to place rows on consecutive pages.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from .errors import PagePoolExhausted

MAX_PAGE_SIZE = 2**16  # tokens; a page is the unit of allocation (typical sizes: 16 to 256)

EVICTED = -1  # a row's entry for a page that an eviction policy dropped


class BlockManager:
    """Hands out page ids; knows nothing about tensors.

    ``max_pages=None`` lets the pool grow geometrically (+25% at a time); an int bounds it.
    Allocation order: a free page (the preferred one when it is free), else the least recently
    used cached page (vLLM v1 order), else growth (into the preferred page when it lies just
    beyond the pool, so rows stay consecutive), else `PagePoolExhausted`. An unbounded pool grows
    only when no page is free or cached: its size stays within a constant factor of the most
    pages ever in use at once, however often cached pages are made and reused.
    """

    cold = None  # a two-tier pool's tiers (`hf_paged.demotion.TieredBlockManager`); None: pages of one tier

    def __init__(self, page_size: int, max_pages: int | None = None, initial_pages: int = 0):
        self.page_size = page_size
        self.max_pages = max_pages  # pages the pool may hold now: the bound, or None (no limit) while overdrawn
        self.bound = max_pages  # the pool's size limit (None: it grows)
        self.overdrawn = False  # one step may take more pages than the bound (a compressed prompt, cut at commit)
        self.num_pages = 0
        self.ref: list[int] = []
        self.free: OrderedDict[int, None] = OrderedDict()
        self.frees = 0  # changes whenever pages holding content may have become free (a new id holds none)
        self.cached: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self.page_hash: dict[int, bytes] = {}
        self.hash_to_page: dict[bytes, int] = {}
        self.cached_evictions = 0
        self.hash_dropped = None  # called (page, hash) when a page loses its hash (set by its `PrefixIndex`)
        self.grow_to(initial_pages)

    # ---------------------------------------------------------------- capacity
    def set_bound(self, max_pages: int | None) -> None:
        """The pool holds at most ``max_pages`` pages from now on (None: it grows)."""
        self.bound = max_pages
        self.max_pages = None if self.overdrawn else max_pages

    def overdraw(self, on: bool) -> None:
        """While on, allocations may take the pool past its bound (``max_pages`` reads None); when off again, the
        caller brings the pages in use back within it (a prompt prefilled whole, cut when its step commits)."""
        self.overdrawn = on
        self.max_pages = None if on else self.bound

    def grow_to(self, num_pages: int) -> None:
        """Extend the id space to ``num_pages`` (capped by ``max_pages``); new ids are free."""
        if self.max_pages is not None:
            num_pages = min(num_pages, self.max_pages)
        for page in range(self.num_pages, num_pages):
            self.ref.append(0)
            self.free[page] = None
        self.num_pages = max(self.num_pages, num_pages)

    def _grown(self) -> int:
        """Next capacity of an unbounded pool: +25% (geometric, so growth is amortised O(1) per page)."""
        return self.num_pages + max(1, self.num_pages // 4)

    def available(self) -> int:
        """Pages obtainable right now without touching referenced pages (growth included)."""
        room = self.num_pages if self.max_pages is None else self.max_pages
        headroom = float("inf") if self.max_pages is None else room - self.num_pages
        return len(self.free) + len(self.cached) + headroom

    def require(self, needed: int, lossy: bool = False) -> None:
        """Raise `PagePoolExhausted` (changing nothing) unless ``needed`` pages can be allocated."""
        available = self.available()
        if needed > available:
            raise PagePoolExhausted(needed, int(available), self.max_pages, self.page_size, lossy)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self.free) - len(self.cached)

    # -------------------------------------------------------------- allocation
    def allocate(self, prefer: int | None = None) -> int:
        """Return a page with reference count 1 (``prefer`` when it is free or can be grown into)."""
        if (prefer is not None and prefer >= self.num_pages and not self.free and not self.cached
                and (self.max_pages is None or prefer < self.max_pages)):
            self.grow_to(max(prefer + 1, self._grown()))  # grow into the preferred page only when full
        if prefer is not None and prefer in self.free:
            del self.free[prefer]
            page = prefer
        elif self.free:
            page, _ = self.free.popitem(last=False)
        elif self.cached:
            page, _ = self.cached.popitem(last=False)
            self._drop_hash(page)
            self.cached_evictions += 1
        elif self.max_pages is None or self.num_pages < self.max_pages:
            self.grow_to(self._grown())
            return self.allocate(prefer)
        else:
            raise PagePoolExhausted(1, 0, self.max_pages, self.page_size)
        self.ref[page] = 1
        return page

    def free_run(self, length: int) -> int | None:
        """First page of ``length`` consecutive free pages, growing an unbounded pool to make room when the
        free and cached pages cannot hold ``length`` pages; None when there is no such run (nor growth)."""
        run_start, run = None, 0
        for page in range(self.num_pages):
            if page in self.free:
                run_start = page if run == 0 else run_start
                run += 1
                if run == length:
                    return run_start
            else:
                run = 0
        if run == 0:
            run_start = self.num_pages
        if self.max_pages is None and len(self.free) + len(self.cached) >= length:
            return None  # the pages are there, if not in a run: reuse them before growing
        if self.max_pages is None or run_start + length <= self.max_pages:
            self.grow_to(max(run_start + length, self._grown()))
            return run_start
        return None

    def share(self, page: int) -> None:
        """One more row references ``page`` (a cached page becomes referenced again)."""
        if self.ref[page] == 0:
            if page not in self.cached:
                raise ValueError(f"page {page} is free: it has no content to share")
            del self.cached[page]
        self.ref[page] += 1

    def release(self, page: int) -> None:
        """One row drops ``page``; unreferenced pages with a hash stay cached, others become free."""
        if self.ref[page] <= 0:
            raise ValueError(f"page {page} released more often than it was referenced")
        self.ref[page] -= 1
        if self.ref[page] == 0:
            if page in self.page_hash:
                self.cached[page] = None  # most recently used end
            else:
                self.free[page] = None
                self.frees += 1

    def release_row(self, pages: list[int]) -> None:
        """Release a row's pages tail first, so its prefix outlives its suffix in the LRU order.

        All or nothing: raises (changing nothing) if a page would be released more often than held.
        """
        counts = Counter(p for p in pages if p != EVICTED)
        if any(self.ref[p] < n for p, n in counts.items()):
            raise ValueError(f"release_row({pages}): a page is released more often than it was referenced")
        for page in reversed(pages):
            if page != EVICTED:
                self.release(page)

    def share_row(self, pages: list[int]) -> None:
        """One more reference on each of a row's pages (evicted entries skipped)."""
        for page in pages:
            if page != EVICTED:
                self.share(page)

    def forget(self, page: int) -> None:
        """Drop ``page``'s content hash (its content is about to change or is incomplete)."""
        self._drop_hash(page)
        if page in self.cached:
            del self.cached[page]
            self.free[page] = None
            self.frees += 1

    # ---------------------------------------------------------- prefix hashes
    def set_hash(self, page: int, content_hash: bytes) -> None:
        """Mark a full, referenced page as holding the content identified by ``content_hash``."""
        if content_hash in self.hash_to_page:
            if self.hash_to_page[content_hash] != page:
                self._drop_hash(page)  # ``page`` no longer holds what its old hash says
            return  # an identical page is already registered; keep the first
        self._drop_hash(page)
        self.page_hash[page] = content_hash
        self.hash_to_page[content_hash] = page

    def lookup(self, content_hash: bytes) -> int | None:
        return self.hash_to_page.get(content_hash)

    def _drop_hash(self, page: int) -> None:
        content_hash = self.page_hash.pop(page, None)
        if content_hash is not None:
            del self.hash_to_page[content_hash]
            if self.hash_dropped is not None:
                self.hash_dropped(page, content_hash)

    def release_all(self) -> None:
        """Drop every reference: pages with a content hash become cached (their content is complete: a page gets
        its hash once computed, and loses it before it is handed out again), others free. It also restores the
        invariants after an operation was interrupted midway (a page in no list, a count that no row holds)."""
        self.frees += 1
        self.hash_to_page = {h: p for p, h in self.page_hash.items()}
        for page in range(self.num_pages):
            self.ref[page] = 0
            if page not in self.free and page not in self.cached:
                (self.cached if page in self.page_hash else self.free)[page] = None
        for page in [p for p in self.free if p in self.page_hash]:
            self._drop_hash(page)
        for page in [p for p in self.cached if p not in self.page_hash]:
            del self.cached[page]
            self.free[page] = None

    def reset(self) -> None:
        """Every page becomes free; hashes are dropped. Capacity is kept."""
        for page in list(self.page_hash):
            self._drop_hash(page)
        self.ref = [0] * self.num_pages
        self.free = OrderedDict.fromkeys(range(self.num_pages))
        self.frees += 1
        self.cached.clear()

    def check_invariants(self) -> None:
        """Assert the invariants stated in the module docstring."""
        referenced = {p for p in range(self.num_pages) if self.ref[p] > 0}
        assert all(r >= 0 for r in self.ref), "negative reference count"
        assert not (set(self.free) & set(self.cached)), "page both free and cached"
        assert not (referenced & (set(self.free) | set(self.cached))), "referenced page in a list"
        assert len(referenced) + len(self.free) + len(self.cached) == self.num_pages, "page lost"
        assert all(p not in self.free for p in self.page_hash), "free page keeps a hash"
        assert {self.hash_to_page[h] for h in self.page_hash.values()} == set(self.page_hash)
        assert all(self.page_hash.get(p) == h for h, p in self.hash_to_page.items()), "stale hash entry"
        assert all(p in self.page_hash for p in self.cached), "cached page without a hash"
        if self.max_pages is not None:  # a compressed prompt may leave more ids than the bound, never more in use
            assert self.num_used <= self.max_pages
