"""hf_paged.block_manager.BlockManager: a stateful property test against a plain model, plus unit tests.

The model mirrors, with plain dicts/lists, what the manager must hold after every operation:
reference counts, which pages are cached and in which LRU order (first = least recently
released, the next one an exhausted free list hands out: vLLM v1 order), content hashes,
capacity and the number of cached pages evicted. References are held by "rows" (lists of page
ids, with `EVICTED` where a lossy eviction policy dropped a page), the way `PageRows` holds them,
so that `release_row` / `share_row` are driven the way the cache drives them.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hf_paged.block_manager import EVICTED, BlockManager
from hf_paged.errors import PagePoolExhausted

PAGE_SIZE = 4
HASHES = [b"h%d" % i for i in range(8)]  # a small pool, so that hashes collide often
SELECT = st.integers(min_value=0, max_value=1 << 16)  # an index, taken modulo the candidates


def snapshot(bm: BlockManager):
    """Everything observable about the manager, orders included."""
    return (bm.num_pages, list(bm.ref), list(bm.free), list(bm.cached), dict(bm.page_hash),
            dict(bm.hash_to_page), bm.cached_evictions)


class Model:
    def __init__(self, max_pages: int | None, initial_pages: int):
        self.max_pages = max_pages
        self.num_pages = 0
        self.ref: dict[int, int] = {}  # referenced pages only (count > 0)
        self.cached: list[int] = []  # LRU order, first = least recently released
        self.page_hash: dict[int, bytes] = {}
        self.evictions = 0
        self.grow_to(initial_pages)

    def cap(self, n: int) -> int:
        return n if self.max_pages is None else min(n, self.max_pages)

    def grow_to(self, n: int) -> None:
        self.num_pages = max(self.num_pages, self.cap(n))

    @property
    def free(self) -> set[int]:
        return set(range(self.num_pages)) - set(self.ref) - set(self.cached)

    @property
    def hash_to_page(self) -> dict[bytes, int]:
        return {h: p for p, h in self.page_hash.items()}

    def available(self):
        if self.max_pages is None:
            return float("inf")
        return len(self.free) + len(self.cached) + self.max_pages - self.num_pages

    def release(self, page: int) -> None:
        self.ref[page] -= 1
        if self.ref[page] == 0:
            del self.ref[page]
            if page in self.page_hash:
                self.cached.append(page)  # most recently released end

    def reset(self) -> None:
        self.ref, self.cached, self.page_hash = {}, [], {}


class BlockManagerMachine(RuleBasedStateMachine):
    """Rules shared by the bounded and the unbounded machine (each has its own `initialize`)."""

    def __init__(self):
        super().__init__()
        self.bm: BlockManager | None = None
        self.model: Model | None = None
        self.rows: list[list[int]] = []  # every reference the model holds sits in one row slot

    def _start(self, max_pages, initial_pages):
        self.bm = BlockManager(PAGE_SIZE, max_pages=max_pages, initial_pages=initial_pages)
        self.model = Model(max_pages, initial_pages)

    # ------------------------------------------------------------------ helpers
    def _add_to_row(self, sel: int, page: int) -> None:
        i = sel % (len(self.rows) + 1)
        if i == len(self.rows):
            self.rows.append([page])
        else:
            self.rows[i].append(page)

    def _live_slots(self) -> list[tuple[int, int]]:
        return [(r, i) for r, row in enumerate(self.rows) for i, p in enumerate(row) if p != EVICTED]

    def _drop_dead_rows(self) -> None:
        self.rows = [row for row in self.rows if any(p != EVICTED for p in row)]

    def _unreferenced(self) -> list[int]:
        return [p for p in range(self.model.num_pages) if p not in self.model.ref]

    # -------------------------------------------------------------- allocation
    def _allocate(self, prefer: int | None) -> int | None:
        """`allocate` checked against the model; None when a bounded pool is exhausted."""
        m, before = self.model, snapshot(self.bm)
        free = m.free
        if prefer is not None and prefer in free:
            kind = "prefer"
        elif free:
            kind = "free"
        elif m.cached:
            kind = "lru"  # before any growth: an unbounded pool grows only when nothing is free or cached
        elif prefer is not None and prefer >= m.num_pages and (m.max_pages is None or prefer < m.max_pages):
            kind = "grow to prefer"  # nothing free or cached: a preferred id the pool can grow into is honoured
        elif m.max_pages is None or m.num_pages < m.max_pages:
            kind = "grow"
        else:
            event("allocate: exhausted")
            with pytest.raises(PagePoolExhausted) as exc:
                self.bm.allocate(prefer)
            assert (exc.value.needed, exc.value.available, exc.value.max_pages) == (1, 0, m.max_pages)
            assert snapshot(self.bm) == before, "a failed allocate changed the manager"
            return None
        event(f"allocate: {kind}")
        page = self.bm.allocate(prefer)
        if kind == "prefer":
            assert page == prefer, "a free preferred page was not honoured"
        elif kind == "grow to prefer":
            assert page == prefer, "a preferred page beyond the pool was not grown into"
            assert prefer < self.bm.num_pages <= m.cap(max(prefer + 1, 2 * m.num_pages))
            m.num_pages = self.bm.num_pages
        elif kind == "free":
            assert page in free, "allocate took a non-free page while free pages remained"
        elif kind == "lru":
            assert page == m.cached[0], "allocate did not evict the least recently released cached page"
            m.cached.pop(0)
            m.page_hash.pop(page)
            m.evictions += 1
        else:
            # geometric growth: at least one page, at most doubling (the exact factor is a policy)
            new_num = self.bm.num_pages
            assert m.cap(m.num_pages + 1) <= new_num <= m.cap(max(2 * m.num_pages, m.num_pages + 1))
            assert m.num_pages <= page < new_num, "growth did not hand out a new page"
            m.num_pages = new_num
        m.ref[page] = 1
        return page

    @rule(row=SELECT, prefer=st.none() | st.integers(min_value=0, max_value=28))
    def allocate(self, row, prefer):
        page = self._allocate(prefer)
        if page is not None:
            self._add_to_row(row, page)

    @rule(length=st.integers(min_value=1, max_value=6), first_hash=st.integers(0, len(HASHES) - 1),
          release=st.booleans())
    def prefill_row(self, length, first_hash, release):
        """A new row of full pages: allocate (preferring consecutive ids), hash, maybe release it."""
        row = []
        for _ in range(length):
            page = self._allocate(row[-1] + 1 if row else None)
            if page is None:
                break
            row.append(page)
        for i, page in enumerate(row):
            self.set_hash_checked(page, HASHES[(first_hash + i) % len(HASHES)])
        if release:
            self.bm.release_row(row)
            for page in reversed(row):
                self.model.release(page)
        elif row:
            self.rows.append(row)

    @precondition(lambda self: self.model.free)
    @rule(row=SELECT)
    def drain_free(self, row):
        """Reference every free page, so that the next allocation evicts, grows or fails."""
        for _ in range(len(self.model.free)):
            self._add_to_row(row, self._allocate(None))
        assert not self.bm.free

    @rule(length=st.integers(min_value=1, max_value=6), take=st.booleans())
    def free_run(self, length, take):
        m, free = self.model, self.model.free
        expected, start = None, 0  # the lowest start whose pages are all free or not yet created
        while m.max_pages is None or start + length <= m.max_pages:
            if all(q in free or q >= m.num_pages for q in range(start, start + length)):
                expected = start
                break
            start += 1
        if m.max_pages is None and (expected is None or expected + length > m.num_pages) \
                and len(free) + len(m.cached) >= length:
            expected = None  # no free run, but free and cached pages enough: an unbounded pool does not grow
        before = snapshot(self.bm)
        got = self.bm.free_run(length)
        event(f"free_run: {'none' if got is None else 'inside' if got + length <= m.num_pages else 'grown'}")
        assert got == expected
        if got is None:
            assert snapshot(self.bm) == before, "a failed free_run changed the manager"
            return
        if got + length <= m.num_pages:
            assert self.bm.num_pages == m.num_pages, "free_run grew the pool although a run was free"
        else:
            assert got + length <= self.bm.num_pages <= m.cap(max(got + length, 2 * m.num_pages))
        m.num_pages = self.bm.num_pages
        assert all(p in self.bm.free for p in range(got, got + length))
        if take:  # place a new row on the run, as step_plan.place_rows does
            pages = [self.bm.allocate(p) for p in range(got, got + length)]
            assert pages == list(range(got, got + length))
            for p in pages:
                m.ref[p] = 1
            self.rows.append(pages)

    @rule(needed=st.integers(min_value=0, max_value=30))
    def require(self, needed):
        m, before = self.model, snapshot(self.bm)
        assert self.bm.available() == m.available()
        if needed > m.available():
            event("require: raises")
            with pytest.raises(PagePoolExhausted) as exc:
                self.bm.require(needed)
            assert (exc.value.needed, exc.value.available, exc.value.max_pages) == (
                needed, m.available(), m.max_pages)
        else:
            self.bm.require(needed)
        assert snapshot(self.bm) == before, "require changed the manager"

    # ------------------------------------------------------------ share/release
    @precondition(lambda self: self.model.ref)
    @rule(sel=SELECT, row=SELECT)
    def share_referenced(self, sel, row):
        pages = sorted(self.model.ref)
        page = pages[sel % len(pages)]
        self.bm.share(page)
        self.model.ref[page] += 1
        self._add_to_row(row, page)

    @precondition(lambda self: self.model.cached)
    @rule(sel=SELECT, row=SELECT)
    def reuse_cached_prefix(self, sel, row):
        """Prefix hit on a cached page: lookup its hash, share it; it leaves the LRU list."""
        m = self.model
        page = m.cached[sel % len(m.cached)]
        assert self.bm.lookup(m.page_hash[page]) == page
        self.bm.share(page)
        m.cached.remove(page)
        m.ref[page] = 1
        self._add_to_row(row, page)

    @rule(content_hash=st.sampled_from(HASHES), row=SELECT)
    def lookup_and_share(self, content_hash, row):
        m = self.model
        page = self.bm.lookup(content_hash)
        assert page == m.hash_to_page.get(content_hash)
        if page is None:
            return
        self.bm.share(page)
        if page in m.cached:
            m.cached.remove(page)
            m.ref[page] = 1
        else:
            m.ref[page] += 1
        self._add_to_row(row, page)

    @precondition(lambda self: self.rows)
    @rule(sel=SELECT)
    def release(self, sel):
        slots = self._live_slots()
        r, i = slots[sel % len(slots)]
        page = self.rows[r].pop(i)
        self._drop_dead_rows()
        self.bm.release(page)
        self.model.release(page)

    @precondition(lambda self: self.rows)
    @rule(sel=SELECT)
    def evict_entry(self, sel):
        """A lossy eviction policy drops one live page of a row (GroupEviction.evict)."""
        slots = self._live_slots()
        r, i = slots[sel % len(slots)]
        page, self.rows[r][i] = self.rows[r][i], EVICTED
        self.bm.release(page)
        self.model.release(page)
        self._drop_dead_rows()

    @precondition(lambda self: self.rows)
    @rule(sel=SELECT)
    def share_row(self, sel):
        """A row is duplicated (beam search / batch_repeat_interleave): its live pages gain a reference."""
        row = list(self.rows[sel % len(self.rows)])
        self.bm.share_row(row)
        for page in row:
            if page != EVICTED:
                self.model.ref[page] += 1
        self.rows.append(row)

    @precondition(lambda self: self.rows)
    @rule(sel=SELECT, keep=SELECT)
    def release_row(self, sel, keep):
        """Release a row's tail ``row[keep:]`` (all of it when keep == 0), as crop/clear do."""
        r = sel % len(self.rows)
        row = self.rows[r]
        keep %= len(row)  # keep < len(row): at least one page is released
        tail = row[keep:]
        self.bm.release_row(tail)
        for page in reversed(tail):
            if page != EVICTED:
                self.model.release(page)
        del row[keep:]
        self._drop_dead_rows()

    @precondition(lambda self: self.model.num_pages > len(self.model.ref))
    @rule(sel=SELECT)
    def release_unreferenced_raises(self, sel):
        pages = self._unreferenced()
        page = pages[sel % len(pages)]
        before = snapshot(self.bm)
        with pytest.raises(ValueError):
            self.bm.release(page)
        assert snapshot(self.bm) == before, "a rejected release changed the manager"

    @precondition(lambda self: self.model.free)
    @rule(sel=SELECT)
    def share_free_raises(self, sel):
        pages = sorted(self.model.free)
        page = pages[sel % len(pages)]
        before = snapshot(self.bm)
        with pytest.raises(ValueError):
            self.bm.share(page)
        assert snapshot(self.bm) == before, "a rejected share changed the manager"

    # ------------------------------------------------------------------ hashes
    @precondition(lambda self: self.model.ref)
    @rule(sel=SELECT, content_hash=st.sampled_from(HASHES))
    def set_hash(self, sel, content_hash):
        pages = sorted(self.model.ref)
        self.set_hash_checked(pages[sel % len(pages)], content_hash)

    def set_hash_checked(self, page: int, content_hash: bytes) -> None:
        m = self.model
        self.bm.set_hash(page, content_hash)
        if content_hash not in m.hash_to_page:  # else the first registered page keeps it
            m.page_hash[page] = content_hash
        elif m.hash_to_page[content_hash] != page:  # and this page's own old hash is stale
            m.page_hash.pop(page, None)

    @precondition(lambda self: self.model.num_pages > 0)
    @rule(sel=SELECT)
    def forget(self, sel):
        m = self.model
        page = sel % m.num_pages
        self.bm.forget(page)
        m.page_hash.pop(page, None)
        if page in m.cached:
            m.cached.remove(page)

    # ---------------------------------------------------------------- capacity
    @rule(num_pages=st.integers(min_value=0, max_value=20))
    def grow_to(self, num_pages):
        self.bm.grow_to(num_pages)
        self.model.grow_to(num_pages)

    @rule()
    def reset(self):
        self.bm.reset()
        self.model.reset()
        self.rows = []

    # --------------------------------------------------------------- invariant
    @invariant()
    def matches_model(self):
        bm, m = self.bm, self.model
        if bm is None:
            return
        bm.check_invariants()
        assert bm.num_pages == m.num_pages
        if m.max_pages is not None:
            assert bm.num_pages <= m.max_pages
        assert len(bm.ref) == bm.num_pages
        assert all(r >= 0 for r in bm.ref)
        assert {p: r for p, r in enumerate(bm.ref) if r} == m.ref
        assert list(bm.cached) == m.cached, "LRU order of cached pages differs from the model"
        assert set(bm.free) == m.free
        assert len(bm.free) + len(bm.cached) + len(m.ref) == bm.num_pages
        assert bm.num_used == len(m.ref)
        assert bm.page_hash == m.page_hash
        assert bm.hash_to_page == m.hash_to_page, "hash maps are not inverse"
        assert all(p in bm.page_hash for p in bm.cached), "a cached page has no hash"
        assert bm.cached_evictions == m.evictions
        # the harness itself: every reference is held by exactly one row slot
        assert Counter(p for row in self.rows for p in row if p != EVICTED) == Counter(m.ref)


class BoundedMachine(BlockManagerMachine):
    @initialize(max_pages=st.integers(min_value=3, max_value=12),
                initial_pages=st.integers(min_value=0, max_value=14))
    def start(self, max_pages, initial_pages):
        self._start(max_pages, initial_pages)


class UnboundedMachine(BlockManagerMachine):
    @initialize(initial_pages=st.integers(min_value=0, max_value=8))
    def start(self, initial_pages):
        self._start(None, initial_pages)


_machine_settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestBoundedBlockManager = BoundedMachine.TestCase
TestBoundedBlockManager.settings = _machine_settings
TestUnboundedBlockManager = UnboundedMachine.TestCase
TestUnboundedBlockManager.settings = _machine_settings


# ------------------------------------------------------------------------ unit tests
def _cached_pages(bm: BlockManager, count: int) -> list[int]:
    """Allocate ``count`` pages, hash them, release them one by one: they end up cached in order."""
    pages = [bm.allocate() for _ in range(count)]
    for i, p in enumerate(pages):
        bm.set_hash(p, b"c%d" % i)
    for p in pages:
        bm.release(p)
    return pages


def test_allocate_takes_free_pages_in_order_then_honours_prefer():
    bm = BlockManager(PAGE_SIZE, max_pages=6, initial_pages=6)
    assert [bm.allocate() for _ in range(2)] == [0, 1]
    assert bm.allocate(prefer=4) == 4
    assert bm.allocate(prefer=0) == 2  # 0 is referenced: the first free page instead
    assert bm.allocate(prefer=6) == 3  # beyond max_pages: ignored
    assert bm.ref == [1, 1, 1, 1, 1, 0]
    assert bm.num_pages == 6


def test_allocate_grows_into_a_preferred_id_beyond_the_pool():
    bm = BlockManager(PAGE_SIZE, initial_pages=4)
    assert bm.allocate(prefer=6) == 0  # a free page exists: no growth for a preference
    assert [bm.allocate() for _ in range(3)] == [1, 2, 3]
    assert bm.allocate(prefer=6) == 6  # nothing free: the pool grows into the preferred page
    assert bm.num_pages >= 7 and [p for p in range(bm.num_pages) if bm.ref[p]] == [0, 1, 2, 3, 6]
    assert {4, 5} <= set(bm.free)
    bm.check_invariants()
    bm = BlockManager(PAGE_SIZE, max_pages=8, initial_pages=4)
    assert [bm.allocate() for _ in range(4)] == [0, 1, 2, 3]
    assert bm.allocate(prefer=8) == 4  # not a page id of this pool: ignored, plain growth
    assert bm.allocate(prefer=7) == 7 and bm.num_pages == 8
    bm.check_invariants()


def test_allocate_prefers_free_over_cached_then_evicts_lru_cached():
    bm = BlockManager(PAGE_SIZE, max_pages=4, initial_pages=4)
    cached = _cached_pages(bm, 3)  # pages 0, 1, 2 cached in this LRU order; 3 free
    assert list(bm.cached) == cached == [0, 1, 2]
    assert bm.allocate(prefer=1) == 3  # free first, even though 1 is preferred (it is cached)
    assert bm.cached_evictions == 0
    assert bm.allocate() == 0  # least recently released cached page
    assert bm.lookup(b"c0") is None and 0 not in bm.page_hash
    assert bm.cached_evictions == 1
    bm.share(2)  # prefix hit: 2 leaves the LRU list...
    bm.release(2)  # ...and returns at the most recently used end
    assert list(bm.cached) == [1, 2]
    assert bm.allocate() == 1
    assert bm.allocate() == 2
    assert bm.cached_evictions == 3
    bm.check_invariants()


def test_unbounded_pool_grows_geometrically_only_when_nothing_is_free():
    bm = BlockManager(PAGE_SIZE)
    sizes = []
    for i in range(1000):
        assert bm.allocate() == i  # ids are handed out densely
        assert bm.num_used == i + 1 and len(bm.free) == bm.num_pages - i - 1
        sizes.append(bm.num_pages)
    growths = [b for a, b in zip([0] + sizes, sizes) if b != a]
    assert growths[0] == 1
    assert all(b > a for a, b in zip(growths, growths[1:]))
    assert all(b <= 2 * a for a, b in zip(growths, growths[1:])), "growth more than doubles"
    assert len(growths) <= 40, f"growth is not geometric (amortised O(1) per page): {growths}"
    assert 1000 <= bm.num_pages <= 2000


def test_unbounded_pool_evicts_cached_before_growing():
    bm = BlockManager(PAGE_SIZE, initial_pages=2)
    _cached_pages(bm, 2)
    assert bm.allocate() == 0 and bm.num_pages == 2  # a cached page is reused before growth
    assert bm.allocate() == 1 and bm.num_pages == 2
    assert bm.allocate(prefer=3) == 3 and bm.num_pages == 4  # growth, preferred new id honoured
    assert bm.allocate() == 2
    bm.check_invariants()


def test_bounded_growth_is_capped_and_exhaustion_changes_nothing():
    bm = BlockManager(PAGE_SIZE, max_pages=5)
    pages = [bm.allocate() for _ in range(5)]
    assert pages == [0, 1, 2, 3, 4] and bm.num_pages == 5
    before = snapshot(bm)
    with pytest.raises(PagePoolExhausted) as exc:
        bm.allocate()
    assert exc.value.needed == 1 and exc.value.available == 0 and exc.value.max_pages == 5
    assert snapshot(bm) == before
    bm.grow_to(50)
    assert bm.num_pages == 5


def test_require_counts_free_cached_and_headroom_and_explains_the_fix():
    bm = BlockManager(PAGE_SIZE, max_pages=8, initial_pages=4)
    _cached_pages(bm, 1)  # page 0 cached
    bm.allocate()  # free page 1 referenced
    assert bm.available() == 7  # 2 free + 1 cached + 4 not yet created
    bm.require(7)
    before = snapshot(bm)
    with pytest.raises(PagePoolExhausted) as exc:
        bm.require(8)
    assert snapshot(bm) == before
    err = exc.value
    assert (err.needed, err.available, err.max_pages) == (8, 7, 8)
    msg = str(err)
    assert "8 new page(s)" in msg and "only 7" in msg
    assert "max_pages=8" in msg and f"page_size={PAGE_SIZE}" in msg
    assert "raise max_pages" in msg.lower() and "eviction=" in msg  # what to change
    with pytest.raises(PagePoolExhausted) as exc:
        bm.require(8, lossy=True)  # a lossy policy already evicts: the advice differs
    assert (exc.value.needed, exc.value.available) == (8, 7)
    assert "max_pages=8" in str(exc.value) and "raise max_pages" in str(exc.value).lower()
    assert str(exc.value) != msg
    assert snapshot(bm) == before
    BlockManager(PAGE_SIZE).require(10**9)  # unbounded: never raises


def test_free_run_finds_consecutive_free_pages():
    bm = BlockManager(PAGE_SIZE, initial_pages=8)
    for p in (0, 3, 4):
        bm.allocate(prefer=p)
    assert bm.free_run(2) == 1  # pages 1, 2
    assert bm.free_run(3) == 5  # pages 5, 6, 7
    assert bm.num_pages == 8  # found inside the pool: no growth


def test_free_run_grows_an_unbounded_pool():
    bm = BlockManager(PAGE_SIZE)
    assert bm.free_run(3) == 0 and bm.num_pages >= 3
    assert all(p in bm.free for p in range(3))
    bm = BlockManager(PAGE_SIZE, initial_pages=4)
    bm.allocate(prefer=0), bm.allocate(prefer=1)
    assert bm.free_run(4) == 2  # the trailing free pages 2, 3 are extended
    assert bm.num_pages >= 6 and all(p in bm.free for p in range(2, 6))
    bm = BlockManager(PAGE_SIZE, initial_pages=4)
    bm.allocate(prefer=3)
    assert bm.free_run(4) == 4  # 0..2 is too short and not at the end: start after the pool
    assert bm.num_pages >= 8 and all(p in bm.free for p in range(4, 8))
    bm.check_invariants()


def test_free_run_in_a_bounded_pool():
    bm = BlockManager(PAGE_SIZE, max_pages=4, initial_pages=4)
    bm.allocate(prefer=0), bm.allocate(prefer=2)
    before = snapshot(bm)
    assert bm.free_run(2) is None  # free pages 1 and 3 are not consecutive
    assert snapshot(bm) == before
    assert bm.free_run(1) == 1
    bm = BlockManager(PAGE_SIZE, max_pages=4, initial_pages=4)
    _cached_pages(bm, 4)
    assert bm.free_run(1) is None  # cached pages are not free
    bm = BlockManager(PAGE_SIZE, max_pages=8, initial_pages=4)
    bm.allocate(prefer=1)
    assert bm.free_run(5) == 2  # 2, 3 free + 4, 5, 6 by growth within max_pages
    assert 7 <= bm.num_pages <= 8
    assert bm.free_run(7) is None  # would need pages up to 8 > max_pages - 1
    bm.check_invariants()


def test_release_row_releases_tail_first_so_the_prefix_outlives_the_suffix():
    bm = BlockManager(PAGE_SIZE, max_pages=4, initial_pages=4)
    row = [bm.allocate() for _ in range(3)]
    for i, p in enumerate(row):
        bm.set_hash(p, b"r%d" % i)
    bm.share(row[0])  # another row shares the first page
    bm.release_row(row)
    assert list(bm.cached) == [row[2], row[1]]  # last page queued first; row[0] still referenced
    assert bm.ref[row[0]] == 1
    bm.release(row[0])
    assert list(bm.cached) == [row[2], row[1], row[0]]
    assert bm.allocate() == 3  # the free page first
    assert bm.allocate() == row[2]  # then the suffix is evicted first
    assert bm.lookup(b"r0") == row[0] and bm.lookup(b"r1") == row[1] and bm.lookup(b"r2") is None
    bm.check_invariants()


def test_release_of_unreferenced_page_and_share_of_free_page_raise_and_change_nothing():
    bm = BlockManager(PAGE_SIZE, initial_pages=3)
    _cached_pages(bm, 1)  # page 0 cached, 1 and 2 free
    before = snapshot(bm)
    for page in (0, 1):
        with pytest.raises(ValueError):
            bm.release(page)
        assert snapshot(bm) == before
    with pytest.raises(ValueError):
        bm.share(1)
    assert snapshot(bm) == before
    bm.share(0)  # a cached page can be shared
    assert bm.ref[0] == 1 and 0 not in bm.cached


def test_forget_moves_a_cached_page_to_free_and_drops_its_hash():
    bm = BlockManager(PAGE_SIZE, initial_pages=3)
    _cached_pages(bm, 2)  # pages 0, 1 cached
    bm.forget(1)
    assert list(bm.cached) == [0] and 1 in bm.free
    assert bm.lookup(b"c1") is None and 1 not in bm.page_hash
    assert bm.lookup(b"c0") == 0
    p = bm.allocate(prefer=0)  # 0 is cached, not free: not honoured
    assert p != 0 and p in (1, 2)
    bm.check_invariants()
    # a referenced page that forgets its hash becomes free, not cached, on release
    bm = BlockManager(PAGE_SIZE, initial_pages=2)
    q = bm.allocate()
    bm.set_hash(q, b"x")
    bm.forget(q)
    assert bm.lookup(b"x") is None and bm.ref[q] == 1
    bm.release(q)
    assert q in bm.free and q not in bm.cached
    bm.check_invariants()


def test_set_hash_keeps_the_first_page_for_a_hash_and_replaces_a_pages_old_hash():
    bm = BlockManager(PAGE_SIZE, initial_pages=3)
    a, b = bm.allocate(), bm.allocate()
    bm.set_hash(a, b"h")
    bm.set_hash(b, b"h")  # identical content already registered: a keeps it
    assert bm.lookup(b"h") == a and b not in bm.page_hash
    bm.set_hash(a, b"g")  # a's content changed: the old hash is dropped
    assert bm.lookup(b"h") is None and bm.lookup(b"g") == a
    assert bm.page_hash == {a: b"g"} and bm.hash_to_page == {b"g": a}
    bm.check_invariants()


def test_reset_frees_every_page_and_drops_hashes_keeping_capacity():
    bm = BlockManager(PAGE_SIZE, initial_pages=4)
    assert [bm.allocate() for _ in range(3)] == [0, 1, 2] and bm.num_pages == 4
    bm.set_hash(0, b"a"), bm.set_hash(1, b"b")
    bm.release(0)  # 0 cached, 1 referenced with a hash, 2 referenced, 3 free
    bm.reset()
    assert bm.num_pages == 4
    assert list(bm.free) == [0, 1, 2, 3] and not bm.cached
    assert bm.ref == [0, 0, 0, 0] and not bm.page_hash and not bm.hash_to_page
    assert bm.lookup(b"a") is None and bm.lookup(b"b") is None
    bm.check_invariants()


def test_release_row_and_share_row_skip_evicted_entries():
    bm = BlockManager(PAGE_SIZE, initial_pages=4)
    row = [bm.allocate() for _ in range(3)]
    for i, p in enumerate(row):
        bm.set_hash(p, b"e%d" % i)
    bm.release(row[1])  # an eviction policy dropped the middle page
    row[1] = EVICTED
    assert list(bm.cached) == [1]
    bm.share_row(row)
    assert bm.ref == [2, 0, 2, 0]
    bm.release_row(row)
    assert bm.ref == [1, 0, 1, 0] and list(bm.cached) == [1]
    bm.release_row(row)
    assert bm.ref == [0, 0, 0, 0] and list(bm.cached) == [1, 2, 0]  # tail first, evicted entry skipped
    bm.check_invariants()
