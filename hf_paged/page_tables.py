"""The sequence core: page tables of sequences over one `BlockManager`, shared by both caches.

A sequence's page table is a list of page ids: entry i holds the tokens of logical page ``first_page + i``
(``EVICTED`` where an eviction policy dropped it); the table holds one reference on each page. `PagedCache`
keeps the rows of one batch in lockstep (`PageRows`: one length and first page for all), `RaggedCache` keeps
sequences of their own lengths; both plan a step with the pieces here:
- which leading pages a sequence still needs (`FullAttention`, `SlidingWindow`: pages freed as they leave the
  window, as vLLM's ``SlidingWindowManager.remove_skipped_blocks``);
- copy-on-write of a shared, partly filled last page (`needs_copy`, `copy_on_write`);
- the undo of a step that fails before every layer wrote it (`StepUndo`);
- the index the paged kernels read, built and checked once per step and device (`kernel_index`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .block_manager import EVICTED, BlockManager
from .kernels.arguments import mark_checked


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
    by copies, trimmed, moved): those are released when the step commits and kept for the rollback until then.
    For a step that only appends pages of its own (``appends_only``), the tables' lengths stand for them.
    ``state``: what else the owner restores (lengths, first pages)."""

    def __init__(self, tables: list[list[int]], appends_only: bool = False, state: tuple = ()):
        self.tables, self.appends_only, self.state = tables, appends_only, state  # tables: restored in place
        self.saved = [len(t) for t in tables] if appends_only else [list(t) for t in tables]
        self.replaced: list[int] = []

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
        for pages in (*edited, self.replaced):
            manager.release_row([p for p in pages if p not in kept])
        for table, saved in zip(self.tables, self.saved):
            table[:] = saved


def copy_on_write(manager: BlockManager, pages: list[int], length: int, undo: StepUndo) -> tuple[int, int] | None:
    """When `needs_copy`: the sequence's last page becomes a fresh copy of it (the caller copies the bytes through
    the page store before the step writes); the shared page is released when the step commits. -> (source, copy)."""
    if not needs_copy(manager, pages, length):
        return None
    source, copy = pages[-1], manager.allocate()
    undo.replaced.append(source)
    pages[-1] = copy
    return source, copy


def kernel_index(memo: dict, device: torch.device, num_pages: int,
                 build: Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """(page_table [R, N], page_pos [R, N], q_pos [R, Q]) for the paged kernels on ``device``, contiguous: ``build()``
    makes them on the host once per step (``memo`` is the step's) and device; int32 pages on CUDA (Triton), int64
    on the CPU (the C kernel's type). The page ids are checked here against pages of ``num_pages`` pages, once per
    step and device (the kernels read pages unchecked; `mark_checked` remembers the check on the table)."""
    key = ("kernel", device)
    index = memo.get(key)
    if index is None:
        table, page_pos, q_pos = build()
        if device.type == "cuda":
            table = table.to(device, torch.int32)
        index = tuple(t.to(device).contiguous() for t in (table, page_pos, q_pos))
        mark_checked(*index, num_pages)
        memo[key] = index
    return index

