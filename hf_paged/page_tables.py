"""The sequence core: page tables of sequences over one `BlockManager`, shared by both caches.

A sequence's page table is a list of page ids: entry i holds the tokens of logical page ``first_page + i``
(``EVICTED`` where an eviction policy dropped it); the table holds one reference on each page. `PagedCache`
keeps the rows of one batch in lockstep (`PageRows`: one length and first page for all; the rectangular special
case), `RaggedCache` keeps sequences of their own lengths; both plan a step with the pieces here:
- which leading pages a sequence still needs (`FullAttention`, `SlidingWindow`: pages freed as they leave the
  window, as vLLM's ``SlidingWindowManager.remove_skipped_blocks``);
- copy-on-write of a shared, partly filled last page (`needs_copy`, `copy_on_write`);
- the undo of a step that fails before every layer wrote it (`StepUndo`);
- the index the paged kernels read, built and checked once per step and device (`kernel_index`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from .block_manager import EVICTED, BlockManager
from .errors import CacheUsageError
from .kernels.arguments import mark_checked
from .prefix_index import PrefixIndex


class FullAttention:
    """Every token stays attended: no page is ever skipped."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.record_past = False  # set by assisted decoding: keep skipped pages until `crop`

    def skipped_tokens(self, num_tokens: int) -> int:
        """Leading tokens that no query after ``num_tokens`` tokens attends."""
        return 0

    def first_needed_page(self, past: int, first_page: int) -> int:
        """First logical page a step starting after ``past`` tokens needs (rows start at ``first_page``)."""
        return max(first_page, self.skipped_tokens(past) // self.page_size)

    def first_kept_page(self, past: int, first_page: int) -> int:
        """First logical page a step starting after ``past`` tokens keeps (all of them while recording the past)."""
        return first_page if self.record_past else self.first_needed_page(past, first_page)


class SlidingWindow(FullAttention):
    """A query attends the last ``size`` tokens, itself included."""

    def __init__(self, size: int, page_size: int):
        super().__init__(page_size)
        self.size = size

    def skipped_tokens(self, num_tokens: int) -> int:
        return max(0, num_tokens - self.size + 1)


def attention_span(sliding_window: int | None, page_size: int) -> FullAttention:
    """What layers with this sliding window (None: full attention) still attend, in pages."""
    return FullAttention(page_size) if sliding_window is None else SlidingWindow(sliding_window, page_size)


def needs_copy(manager: BlockManager, pages: list[int], length: int) -> bool:
    """The next token of a sequence of ``length`` tokens goes into a partly filled page that another sequence shares."""
    return length % manager.page_size != 0 and manager.ref[pages[-1]] > 1


class StepUndo:
    """The page tables a step edits as they were before it, and the pages the step took out of them (replaced
    by copies, trimmed, moved): those are released when the step commits and kept for the rollback until then,
    except ``unshared`` pages (copied from, released at once while another table still holds them), whose
    reference the rollback takes back. For a step that only appends pages of its own (``appends_only``), the
    tables' lengths stand for them. ``state``: what else the owner restores (lengths, first pages)."""

    def __init__(self, tables: list[list[int]], appends_only: bool = False, state: tuple = ()):
        self.tables, self.appends_only, self.state = tables, appends_only, state  # tables: restored in place
        self.saved = [len(t) for t in tables] if appends_only else [list(t) for t in tables]
        self.replaced: list[int] = []
        self.unshared: list[int] = []

    def commit(self, manager: BlockManager) -> None:
        if self.replaced:
            manager.release_row(self.replaced)

    def rollback(self, manager: BlockManager, edited: list[list[int]]) -> None:
        """Release the pages the step brought in (in the ``edited`` tables, which include any table the step made,
        or among the replaced pages) and restore the saved tables in place."""
        if self.appends_only:
            for table, length in zip(self.tables, self.saved):
                manager.release_row(table[length:])
                del table[length:]
            return
        kept = {p for t in self.saved for p in t}
        manager.share_row(self.unshared)
        for pages in (*edited, self.replaced):
            manager.release_row([p for p in pages if p not in kept])
        for table, saved in zip(self.tables, self.saved):
            table[:] = saved


def copy_on_write(manager: BlockManager, pages: list[int], length: int, undo: StepUndo,
                  release_now: bool = False) -> tuple[int, int] | None:
    """When `needs_copy`: the sequence's last page becomes a fresh copy of it (the caller copies the bytes through
    the page store before the step writes); the shared page is released when the step commits, or at once with
    ``release_now`` (so that its last holder in this step finds it unshared and writes in place). -> (source, copy)."""
    if not needs_copy(manager, pages, length):
        return None
    source, copy = pages[-1], manager.allocate()
    if release_now:
        manager.release(source)  # (another table still holds it: needs_copy saw a second reference)
        undo.unshared.append(source)
    else:
        undo.replaced.append(source)
    pages[-1] = copy
    return source, copy


def query_positions(rows: int, past: int, q_len: int) -> torch.Tensor:
    """``[rows, q_len]`` (int64, host): the positions of a step's new tokens after ``past`` tokens (the kernels'
    q_pos)."""
    return torch.from_numpy(np.arange(past, past + q_len)[None].repeat(rows, axis=0))


def kernel_index(memo: dict, device: torch.device, num_pages: int,
                 build: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]], name: str = "kernel"):
    """(page_table [R, N], page_pos [R, N], q_pos [R, Q]) for the paged kernels on ``device``, contiguous: ``build()``
    makes them on the host once per step (``memo`` is the step's, ``name`` tells a step's indexes apart) and device
    (`remember_kernel_index`)."""
    index = memo.get((name, device))
    return index if index is not None else remember_kernel_index(memo, device, num_pages, build(), name)


def remember_kernel_index(memo: dict, device: torch.device, num_pages: int,
                          rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], name: str = "kernel"):
    """The kernel index of the host ``rows`` (page_table, page_pos, q_pos) on ``device``, kept in ``memo`` (a step's):
    int32 pages on CUDA (Triton), int64 on the CPU (the C kernel's type). The page ids are checked here against
    pages of ``num_pages`` pages, once per step and device (the kernels read pages unchecked; `mark_checked`
    remembers the check on the table, so a table kept over steps is checked once). `kernel_index` builds the rows
    per plan; `eviction.PlanStack` gives every layer's of a step at once."""
    table, page_pos, q_pos = rows
    if device.type == "cuda":
        table = table.to(device, torch.int32)
    moved = (table, page_pos, q_pos) if device.type == "cpu" else (t.to(device) for t in (table, page_pos, q_pos))
    index = tuple(t.contiguous() for t in moved)
    mark_checked(*index, num_pages)
    memo[(name, device)] = index
    return index


class PageRows:
    """The page tables of the rows of one batch in one layer group, advancing in lockstep, between steps; the edits
    here (prefix restore, remap, crop, release) keep the invariants, `LayerGroup` adds the steps.

    Invariants:
    - ``len(rows) == batch size``; every row holds the pages of the logical pages
      ``first_page .. first_page + len(row) - 1``, i.e. the tokens ``[first_page * S, num_tokens)``;
    - a row holds one reference on each of its pages (`EVICTED` entries hold none);
    - ``num_tokens`` counts every token processed, whatever was freed (positions never shift).
    """

    def __init__(self, manager: BlockManager, sliding_window: int | None = None, prefix: PrefixIndex | None = None):
        self.manager = manager
        self.prefix = prefix or PrefixIndex(manager)  # the hashes of the manager's pages (shared by forks)
        self.page_size = manager.page_size
        self.sliding_window = sliding_window
        self.window = attention_span(sliding_window, manager.page_size)  # which leading pages are still needed
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
        """First logical page a step starting after ``past`` tokens keeps (see `FullAttention.first_kept_page`)."""
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
    def register_hashes(self, row_hashes: list[list[bytes]], generated: bool = False) -> None:
        """Give the rows' full pages their content hashes (they become reusable once released); ``generated``: they
        were filled by decode steps (see `PrefixIndex.register_pages`)."""
        full = min(self.num_tokens // self.page_size, *(len(h) for h in row_hashes)) if row_hashes else 0
        for row, hashes in zip(self.rows, row_hashes):
            self.prefix.register_pages(row, hashes, self.first_page, self.hashed_pages, full, generated)
        self.hashed_pages = max(self.hashed_pages, full)

    def _needed_pages(self, pages: int) -> range:
        """Logical pages a group must hold after reusing ``pages`` full pages."""
        return range(self.first_kept_page(pages * self.page_size, first_page=0), pages)

    def can_restore(self, row_hashes: list[list[bytes]], pages: int) -> bool:
        needed = self._needed_pages(pages)
        return all(len(self.prefix.cached_run(h, needed.stop, needed.start)) == len(needed) for h in row_hashes)

    def restore(self, row_hashes: list[list[bytes]], pages: int) -> None:
        """Rows become the cached pages of their first ``pages`` pages (shared, counted as hits)."""
        needed = self._needed_pages(pages)
        self.rows = [[self.prefix.lookup(h[i]) for i in needed] for h in row_hashes]
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
