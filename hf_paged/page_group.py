"""`PageGroup`: the page tables of one group of layers (layers that keep the same tokens) and its steps.

A forward step is planned once per group, by the first layer of the group that sees it, and
reused by every other layer (`StepPlan`, in `step_plan`). `begin_step` checks the step, reserves
its pages (evicting per the policy, in `eviction`, when a bounded pool is full), then applies it;
until the step commits, the pages it replaced are held so that `abort_step` can restore the rows.
Which leading pages a step still needs is the group's `window`'s business.

Invariants between steps:
- ``len(rows) == batch size``; every row holds the pages of the logical pages
  ``first_page .. first_page + len(row) - 1``, i.e. the tokens ``[first_page * S, num_tokens)``;
- a row holds one reference on each of its pages;
- ``num_tokens`` counts every token processed, whatever was freed (positions never shift).
"""

from __future__ import annotations

import math
import weakref

from .block_manager import EVICTED, BlockManager
from .errors import CacheUsageError
from .eviction import EvictionPolicy, GroupEviction
from .paged_kv import PagedView
from .step_plan import StepPlan, build_plan, place_rows, relocate_rows
from .window import make_window


class PageGroup:
    """Rows' page tables for one group of layers, all rows advancing in lockstep."""

    def __init__(self, manager: BlockManager, sliding_window: int | None = None,
                 policy: EvictionPolicy | None = None):
        self.manager = manager
        self.policy = policy or EvictionPolicy("error")
        self.eviction = GroupEviction(self.policy, manager.max_pages is not None)
        self._compress_to: int | None = None  # the bound to cut to once a compressed prompt's step commits
        self.page_size = manager.page_size
        self.sliding_window = sliding_window
        self.window = make_window(sliding_window, manager.page_size)
        self.rows: list[list[int]] = []
        self.first_page = 0
        self.num_tokens = 0
        self.step: StepPlan | None = None
        self._undo: tuple | None = None  # (rows, first_page, num_tokens) before an uncommitted step
        self._pending_release: list[int] = []
        self.written = weakref.WeakKeyDictionary()  # member layer -> tokens it wrote (weak: a dropped cache frees)
        self.prefix_hits = 0  # pages reused from the prefix cache instead of recomputed
        self.hashed_pages = 0  # logical pages [0, hashed_pages) of every row carry content hashes
        self.exact_tokens = math.inf  # tokens computed before the first eviction (they match a full forward)

    # ----------------------------------------------------------------- views
    @property
    def record_past(self) -> bool:
        """Set by assisted decoding: keep sliding-window pages until `crop`."""
        return self.window.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self.window.record_past = value

    def first_kept_page(self, past: int, first_page: int | None = None) -> int:
        """First logical page a step starting after ``past`` tokens keeps (see `FullWindow.first_kept_page`)."""
        return self.window.first_kept_page(past, self.first_page if first_page is None else first_page)

    def mask_sizes(self, q_len: int) -> tuple[int, int]:
        """(kv_length, kv_offset) that the next step's attention reads, as transformers expects."""
        kv_offset = self.first_kept_page(self.num_tokens) * self.page_size
        return self.num_tokens + q_len - kv_offset, kv_offset

    def read_view(self, keys, values, backend: str) -> PagedView:
        """What attention reads of a layer of this group in the current step (pools ``keys``/``values``)."""
        window = self.policy.window
        return PagedView(keys, values, self.step.on(keys.device), backend, self.eviction.sink(self.step), window)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def evictions(self) -> int:
        return self.eviction.evictions

    def tokens_stored(self) -> int:
        S = self.page_size
        return sum(min(S, self.num_tokens - (self.first_page + i) * S)
                   for r in self.rows for i, p in enumerate(r) if p != EVICTED)

    def __del__(self):
        """A dropped cache (or fork) gives its pages back: unreferenced, then cached or free."""
        try:
            self.clear()
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass

    def fork(self) -> "PageGroup":
        """A group with the same rows, sharing every page (one more reference each)."""
        self.commit()
        twin = PageGroup(self.manager, self.sliding_window, self.policy)
        twin.eviction = self.eviction.fork(self.manager.max_pages is not None)
        twin.rows = [list(r) for r in self.rows]
        for r in twin.rows:
            self.manager.share_row(r)
        twin.first_page, twin.num_tokens, twin.record_past = self.first_page, self.num_tokens, self.record_past
        twin.hashed_pages, twin.exact_tokens = self.hashed_pages, self.exact_tokens
        return twin

    # -------------------------------------------------------- prefix caching
    def register_hashes(self, row_hashes: list[list[bytes]]) -> None:
        """Give the rows' full pages their content hashes (they become reusable once released)."""
        full = min(self.num_tokens // self.page_size, *(len(h) for h in row_hashes)) if row_hashes else 0
        for row, hashes in zip(self.rows, row_hashes):
            for i in range(max(self.first_page, self.hashed_pages), full):
                if row[i - self.first_page] != EVICTED:
                    self.manager.set_hash(row[i - self.first_page], hashes[i])
        self.hashed_pages = max(self.hashed_pages, full)

    def _needed_pages(self, pages: int) -> range:
        """Logical pages a group must hold after reusing ``pages`` full pages."""
        return range(self.first_kept_page(pages * self.page_size, first_page=0), pages)

    def can_restore(self, row_hashes: list[list[bytes]], pages: int) -> bool:
        return all(self.manager.lookup(h[i]) is not None for h in row_hashes for i in self._needed_pages(pages))

    def restore(self, row_hashes: list[list[bytes]], pages: int) -> None:
        """Rows become the cached pages of their first ``pages`` pages (shared, counted as hits)."""
        needed = self._needed_pages(pages)
        self.rows = [[self.manager.lookup(h[i]) for i in needed] for h in row_hashes]
        for r in self.rows:
            self.manager.share_row(r)
        self.first_page, self.num_tokens, self.hashed_pages = needed.start, pages * self.page_size, pages
        self.prefix_hits += len(needed) * len(self.rows)
        self._all_written()

    # ------------------------------------------------------------- row edits
    def remap(self, rows_for) -> None:
        """Rows become ``rows_for(old rows)`` (reordered, repeated or selected), sharing pages (no K/V copy)."""
        self.commit()
        if not self.rows:  # an empty group has no rows to remap
            return
        new = [list(r) for r in rows_for(self.rows)]
        for r in new:
            self.manager.share_row(r)
        for r in self.rows:
            self.manager.release_row(r)
        self.rows, self.step = new, None

    def stats(self) -> dict:
        """This group's page accounting, and the K/V bytes of its layers' used + cached pages and pools."""
        m = self.manager
        out = dict(pages_total=m.num_pages, pages_used=m.num_used, pages_free=len(m.free), pages_cached=len(m.cached),
                   tokens_stored=self.tokens_stored(), kv_bytes=0, pool_bytes=0, evictions=self.evictions,
                   prefix_hits=self.prefix_hits)
        for layer in self.written:
            if layer.is_initialized:
                page_bytes = sum(t[0].numel() * t.element_size() for t in (layer.keys, layer.values))
                out["kv_bytes"] += (m.num_used + len(m.cached)) * page_bytes
                out["pool_bytes"] += page_bytes * layer.keys.shape[0]
        return out

    def clear(self) -> None:
        """Release every row (tail first); the group is empty afterwards."""
        self.commit()
        for r in self.rows:
            self.manager.release_row(r)
        self.rows, self.first_page, self.num_tokens, self.step, self.hashed_pages = [], 0, 0, None, 0
        self.exact_tokens = math.inf
        self._all_written()

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if cropping would need tokens this group no longer holds."""
        new_len = self.num_tokens - tokens_to_remove
        if tokens_to_remove <= 0:
            return
        needed_from = self.window.skipped_tokens(new_len)
        if needed_from < self.first_page * self.page_size:
            raise CacheUsageError(
                f"cannot crop {tokens_to_remove} tokens: the next step would attend from position {needed_from}, "
                f"but only the tokens from position {self.first_page * self.page_size} on are still held "
                "(sliding window). Call cache.activate_past_recording() before generating to keep them until crop().")
        keep = math.ceil(new_len / self.page_size) - self.first_page
        if any(r[keep - 1] == EVICTED for r in self.rows if keep > 0):
            raise CacheUsageError(f"cannot crop to {new_len} tokens: the page holding the last kept token was "
                                  "evicted. Crop less, or raise max_pages.")

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``tokens_to_remove`` tokens of every row, releasing emptied pages."""
        self.commit()
        self.check_crop(tokens_to_remove)
        new_len = self.num_tokens - tokens_to_remove
        if tokens_to_remove <= 0:
            self._trim_recorded_past()
            self._all_written()
            return
        keep = math.ceil(new_len / self.page_size) - self.first_page
        for r in self.rows:
            self.manager.release_row(r[keep:])
            del r[keep:]
            if r and new_len % self.page_size:
                self.manager.forget(r[-1])  # the page is partial again: its content hash is stale
        self.num_tokens, self.step = new_len, None
        self.hashed_pages = min(self.hashed_pages, new_len // self.page_size)
        self._trim_recorded_past()
        self._all_written()

    def _trim_recorded_past(self) -> None:
        """After a crop, free the sliding-window pages kept for it (see `record_past`)."""
        if not self.record_past:
            return
        trim = self.window.first_needed_page(self.num_tokens, self.first_page) - self.first_page
        for r in self.rows:
            self.manager.release_row(r[:trim])
            del r[:trim]
        self.first_page += trim

    # ------------------------------------------------------------ membership
    def join(self, layer, tokens: int = 0) -> None:
        """``layer`` is a member of this group, having written ``tokens`` tokens."""
        self.written[layer] = tokens

    def tokens_written(self, layer) -> int:
        """Tokens ``layer`` wrote: the group's, or mid-step the tokens before the step until it writes."""
        return self.written[layer]

    def up_to_date(self, layer) -> bool:
        """``layer`` wrote every token of the group (its next update starts a new step)."""
        return self.written[layer] == self.num_tokens

    def wrote(self, layer) -> None:
        """``layer`` wrote the tokens of the current step."""
        self.written[layer] = self.num_tokens

    def _all_written(self) -> None:
        """Every member holds the group's tokens (after a restore or a crop)."""
        for layer in self.written:
            self.written[layer] = self.num_tokens

    def join_step(self, layer, batch_size: int, q_len: int, identical_rows) -> StepPlan:
        """The plan of the step ``layer`` writes now: the group plans it when the layer is the first member
        to write new tokens (``identical_rows()`` then tells which rows of a fresh batch may share pages).
        Raises when the layer's tokens are not those of the planned step."""
        if self.up_to_date(layer):
            fresh_batch = self.num_tokens == 0 and not self.rows and batch_size > 1
            return self.begin_step(batch_size, q_len, identical_rows() if fresh_batch else None)
        if self.step is None or self.written[layer] + q_len != self.num_tokens or batch_size != self.step.batch_size:
            raise CacheUsageError(
                f"layer {layer.layer_idx} received {q_len} token(s) for a batch of {batch_size}, but its group "
                f"planned a step of {self.step.q_len if self.step else 0} token(s) for "
                f"{self.batch_size} row(s): every layer must see the same tokens in the same step. (An "
                "encoder-decoder model such as T5 or BART gives the cache its cross-attention keys too: PagedCache "
                "supports decoder-only models only.)"
            )
        return self.step

    # ------------------------------------------------------------------ step
    def begin_step(self, batch_size: int, q_len: int, same_as: list[int] | None = None) -> StepPlan:
        """Allocate pages for ``q_len`` new tokens per row and plan the writes.

        ``same_as[b] = a`` (a <= b) says rows a and b of a fresh batch hold identical tokens (as
        when generate repeats a prompt for beams or samples): row b then shares row a's pages.

        Raises (changing nothing) when the batch size differs from the cached rows or a
        bounded pool cannot provide the pages.
        """
        self._finish_or_rollback()
        self._check_step(batch_size)
        S, past = self.page_size, self.num_tokens
        fresh = not self.rows
        rows = self.rows if self.rows else [[] for _ in range(batch_size)]
        same_as = same_as if fresh and same_as and any(a != b for b, a in enumerate(same_as)) else None
        owners = [b for b in range(batch_size) if same_as is None or same_as[b] == b]
        new_per_row = math.ceil((past + q_len) / S) - (self.first_page + len(rows[0]))
        cow_rows = [b for b, r in enumerate(rows) if past % S != 0 and self.manager.ref[r[-1]] > 1]
        self._reserve(len(owners) * new_per_row + len(cow_rows), fresh)
        return self._apply(rows, q_len, owners, new_per_row, cow_rows, same_as)

    def _check_step(self, batch_size: int) -> None:
        """Raise (changing nothing) for a step this group cannot take."""
        if self.num_tokens > 0 and batch_size != len(self.rows):
            raise CacheUsageError(
                f"batch size changed from {len(self.rows)} to {batch_size} on a non-empty PagedCache. "
                "Call cache.reset() (or use a new cache) before a new batch; beam search and "
                "num_return_sequences reorder rows through reorder_cache/batch_repeat_interleave."
            )
        if self.manager.max_pages is not None and self.manager.max_pages < batch_size:
            raise CacheUsageError(
                f"max_pages={self.manager.max_pages} is smaller than one page per row for a batch of "
                f"{batch_size}: raise max_pages to at least {batch_size} (better: enough pages for the "
                "prompt and the new tokens of every row) or split the batch.")

    def _reserve(self, needed: int, fresh: bool) -> None:
        """Make ``needed`` pages available (evicting per a lossy policy), or raise `PagePoolExhausted`."""
        if self.policy.compress_prompt and fresh and self.manager.max_pages is not None and \
                needed > self.manager.available():  # the prompt goes in whole, then is cut (see `_compress`)
            self._compress_to, self.manager.max_pages = self.manager.max_pages, None
        elif self.policy.lossy and needed > self.manager.available():
            self._evict(needed)
        self.manager.require(needed, self.policy.lossy)

    def _apply(self, rows, q_len, owners, new_per_row, cow_rows, same_as) -> StepPlan:
        """Give the rows their new pages (nothing raises: `_reserve` checked the pool) and plan the step.

        Pages leaving the rows are released only when the step commits, so that `abort_step` can
        restore them.
        """
        past = self.num_tokens
        new_first = self.first_kept_page(past)
        trim = new_first - self.first_page
        self._undo = ([list(r) for r in self.rows], self.first_page, self.num_tokens)
        self._pending_release = [p for r in rows for p in r[:trim]]
        for r in rows:
            del r[:trim]
        self.first_page = new_first
        src, dst = [], []
        for b in cow_rows:  # copy-on-write: the row gets its own copy of the shared partial page
            src.append(rows[b][-1]), dst.append(self.manager.allocate())
            self._pending_release.append(src[-1])
            rows[b][-1] = dst[-1]
        was_slab = self.step is not None and self.step.slab is not None
        place_rows(self.manager, [rows[b] for b in owners], new_per_row)
        for b, a in enumerate(same_as or ()):
            if a != b:
                rows[b] = list(rows[a])
                self.manager.share_row(rows[b])
        self.rows = rows
        self.num_tokens = past + q_len
        self.step = self._plan(past, src, dst, same_as)
        if was_slab and self.step.slab is None and relocate_rows(self.manager, rows, src, dst, self._pending_release):
            self.step = self._plan(past, src, dst, same_as)
        return self.step

    def _plan(self, past, src, dst, same_as) -> StepPlan:
        plan = build_plan(self.rows, self.first_page, past, self.num_tokens, self.page_size, src, dst, same_as,
                          self.eviction.tracks_usage)
        self.eviction.planned(plan)
        return plan

    def _compress(self) -> None:
        """After a prompt prefilled whole (``compress_prompt``): evict down to the bound, by the
        attention of the prompt's last queries. The pool keeps the prompt's size (its peak)."""
        self.manager.max_pages, self._compress_to = self._compress_to, None
        self._evict(0)

    def _evict(self, needed: int) -> None:
        """Drop live pages per the policy until ``needed`` pages are free; later tokens are not exact."""
        self.exact_tokens = min(self.exact_tokens, self.num_tokens)  # later tokens see fewer: not reusable
        self.eviction.evict(self.manager, self.rows, self.first_page, needed)

    def unshare(self, rows: list[int]) -> None:
        """Give rows that were assumed identical to another row their own pages, mid-step.

        Members that already wrote this step copy the shared pages to the new ones (their content
        was identical); the step's plan is rebuilt for the other members.
        """
        plan = self.step
        self.manager.require(sum(len(self.rows[b]) for b in rows))
        pairs = []
        for b in rows:
            new = [self.manager.allocate() for _ in self.rows[b]]
            pairs += zip(self.rows[b], new)
            self.manager.release_row(self.rows[b])
            self.rows[b] = new
        same_as = [b if b in rows else a for b, a in enumerate(plan.same_as)]
        self.step = self._plan(plan.past, [], [], same_as)
        for layer in [layer for layer, tokens in self.written.items() if tokens == self.num_tokens]:
            layer.copy_pages(pairs)  # it wrote the shared pages: their content is the rows' too

    @property
    def step_open(self) -> bool:
        """A step was planned and is not yet committed or rolled back."""
        return self._undo is not None

    def step_complete(self) -> bool:
        """Every layer of the group wrote the tokens of the last planned step."""
        return all(tokens == self.num_tokens for tokens in self.written.values())

    def _finish_or_rollback(self) -> None:
        """Commit the previous step, or roll it back if some layer of the group never wrote it."""
        if self._undo is None:
            return
        if self.step_complete():
            self.commit()
        else:
            self.abort_step()

    def commit(self) -> None:
        """Make the current step final: release the pages it replaced or trimmed."""
        self.eviction.record(self.step)
        if self._undo is None:
            return
        self.manager.release_row(self._pending_release)
        self._undo, self._pending_release = None, []
        if self._compress_to is not None:
            self._compress()

    def abort_step(self) -> None:
        """Undo the current step: pages it allocated are released, tables restored."""
        if self._undo is None:
            return
        old_rows, old_first, old_tokens = self._undo
        kept = {p for r in old_rows for p in r}
        for pages in (*self.rows, self._pending_release):  # pages this step allocated
            self.manager.release_row([p for p in pages if p not in kept])
        self.rows, self.first_page, self.num_tokens = old_rows, old_first, old_tokens
        for layer, tokens in self.written.items():
            self.written[layer] = min(tokens, old_tokens)
        self.step, self._undo, self._pending_release = None, None, []
        if self._compress_to is not None:  # nothing is held any more: only the bound comes back
            self.manager.max_pages, self._compress_to = self._compress_to, None
