"""`PageRows`: which page holds each logical page of each row of a group, between steps.

The rows of a group advance in lockstep. Edits here (prefix restore, remap, crop, release)
keep the invariants; `PageGroup` adds the steps that append tokens.

Invariants:
- ``len(rows) == batch size``; every row holds the pages of the logical pages
  ``first_page .. first_page + len(row) - 1``, i.e. the tokens ``[first_page * S, num_tokens)``;
- a row holds one reference on each of its pages (`EVICTED` entries hold none);
- ``num_tokens`` counts every token processed, whatever was freed (positions never shift).
"""

from __future__ import annotations

import math

from .block_manager import EVICTED, BlockManager
from .errors import CacheUsageError
from .window import make_window


class PageRows:
    """The page tables of a group's rows, and the edits that keep them consistent."""

    def __init__(self, manager: BlockManager, sliding_window: int | None = None):
        self.manager = manager
        self.page_size = manager.page_size
        self.sliding_window = sliding_window
        self.window = make_window(sliding_window, manager.page_size)  # which leading pages are still needed
        self.rows: list[list[int]] = []
        self.first_page = 0
        self.num_tokens = 0
        self.prefix_hits = 0  # pages reused from the prefix cache instead of recomputed
        self.hashed_pages = 0  # logical pages [0, hashed_pages) of every row carry content hashes

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

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def tokens_stored(self) -> int:
        S = self.page_size
        return sum(min(S, self.num_tokens - (self.first_page + i) * S)
                   for r in self.rows for i, p in enumerate(r) if p != EVICTED)

    def check_batch(self, batch_size: int) -> None:
        """Raise (changing nothing) when these rows cannot take a step of ``batch_size`` rows."""
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

    def share_into(self, twin: "PageRows") -> None:
        """``twin`` gets the same rows, sharing every page (one more reference each)."""
        twin.rows = [list(r) for r in self.rows]
        for r in twin.rows:
            self.manager.share_row(r)
        twin.first_page, twin.num_tokens, twin.record_past = self.first_page, self.num_tokens, self.record_past
        twin.hashed_pages = self.hashed_pages

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

    # ------------------------------------------------------------- row edits
    def remap(self, rows_for) -> None:
        """Rows become ``rows_for(old rows)`` (reordered, repeated or selected), sharing pages (no K/V copy)."""
        new = [list(r) for r in rows_for(self.rows)]
        for r in new:
            self.manager.share_row(r)
        for r in self.rows:
            self.manager.release_row(r)
        self.rows = new

    def clear(self) -> None:
        """Release every row (tail first); no rows are left."""
        for r in self.rows:
            self.manager.release_row(r)
        self.rows, self.first_page, self.num_tokens, self.hashed_pages = [], 0, 0, 0

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if cropping would need tokens these rows no longer hold."""
        new_len = self.num_tokens - tokens_to_remove
        if tokens_to_remove <= 0 or new_len <= 0:  # (cropping everything empties the rows)
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
        """Forget the last ``tokens_to_remove`` tokens of every row, releasing emptied pages; as many as the rows
        hold or more: the rows go (`clear`), as DynamicCache's tensors become empty."""
        self.check_crop(tokens_to_remove)
        if self.rows and tokens_to_remove >= self.num_tokens:
            self.clear()
        elif tokens_to_remove > 0:
            new_len = self.num_tokens - tokens_to_remove
            keep = math.ceil(new_len / self.page_size) - self.first_page
            for r in self.rows:
                self.manager.release_row(r[keep:])
                del r[keep:]
                if r and new_len % self.page_size:
                    self.manager.forget(r[-1])  # the page is partial again: its content hash is stale
            self.num_tokens = new_len
            self.hashed_pages = min(self.hashed_pages, new_len // self.page_size)
        self._trim_recorded_past()

    def _trim_recorded_past(self) -> None:
        """After a crop, free the sliding-window pages kept for it (see `record_past`)."""
        if not self.record_past:
            return
        trim = self.window.first_needed_page(self.num_tokens, self.first_page) - self.first_page
        for r in self.rows:
            self.manager.release_row(r[:trim])
            del r[:trim]
        self.first_page += trim


class RowsUndo:
    """The rows as they were before an uncommitted step, and the pages the step took out of them:
    released when the step commits, given back when it is rolled back. For a step that only appends
    pages of its own to the rows (``appends_only``), the rows' lengths stand for them."""

    def __init__(self, rows: PageRows, appends_only: bool = False):
        self.first_page, self.num_tokens, self.appends_only = rows.first_page, rows.num_tokens, appends_only
        self.rows = [len(r) for r in rows.rows] if appends_only else [list(r) for r in rows.rows]
        self.replaced: list[int] = []

    def commit(self, manager: BlockManager) -> None:
        if self.replaced:
            manager.release_row(self.replaced)

    def rollback(self, rows: PageRows) -> None:
        """``rows`` return to their state before the step; pages the step allocated are released."""
        if self.appends_only:
            for row, length in zip(rows.rows, self.rows):
                rows.manager.release_row(row[length:])
                del row[length:]
        else:
            kept = {p for r in self.rows for p in r}
            for pages in (*rows.rows, self.replaced):
                rows.manager.release_row([p for p in pages if p not in kept])
            rows.rows = self.rows
        rows.first_page, rows.num_tokens = self.first_page, self.num_tokens
