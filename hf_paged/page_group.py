"""The page tables of one group of layers (layers that keep the same tokens) and its step plan.

A forward step is planned once per group, by the first layer of the group that sees it, and
reused by every other layer: which pages the new tokens go to (slot indices), which shared
pages must be copied before writing (copy-on-write), and how each row's pages can be read
(a strided view when the batch's pages form a regular slab, else a gather index).

Invariants between steps:
- ``len(rows) == batch size``; every row holds the pages of the logical pages
  ``first_page .. first_page + len(row) - 1``, i.e. the tokens ``[first_page * S, num_tokens)``;
- a row holds one reference on each of its pages;
- ``num_tokens`` counts every token processed, whatever was freed (positions never shift).
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass, field

import torch

from .block_manager import EVICTED, BlockManager
from .errors import CacheUsageError
from .eviction import EvictionPolicy, PageUsage, warn_first_eviction
from .kernels.arguments import mark_checked


@dataclass
class StepPlan:
    """What every layer of a group needs for one forward step; computed once, on the CPU."""

    batch_size: int
    q_len: int
    past: int  # tokens cached before this step
    num_tokens: int  # tokens cached after this step
    first_pos: int  # logical position of the first token still held (same for every row)
    table: torch.Tensor  # long [B, N]: the rows' pages, logical order
    slots: torch.Tensor  # long [B * q_len]: flat slot (page * S + offset) of each new token
    copy_src: torch.Tensor | None  # long [C]: pages to copy before writing (copy-on-write)
    copy_dst: torch.Tensor | None
    slab: tuple[int, int] | None  # (first page, row stride in pages) when rows form a regular slab
    page_size: int = 1
    same_as: list[int] | None = None  # rows assumed identical to an earlier row (sharing its pages)
    read_table: torch.Tensor | None = None  # long [B, Nk]: live pages only (-1 padded), when rows have holes
    read_pos: torch.Tensor | None = None  # long [B, Nk]: logical position of each live page's first token
    usage: torch.Tensor | None = None  # float [B, Nk]: attention mass per live page this step, summed over layers
    _on_device: dict = field(default_factory=dict)

    @property
    def kv_len(self) -> int:
        return self.num_tokens - self.first_pos

    def kernel_index(self, device: torch.device, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table [B, N], page_pos [B, N], q_pos [B, Q]) for the paged kernels, contiguous, once per
        device: int32 pages on CUDA (Triton), int64 on the CPU (the C kernel's type). The page ids are
        checked here, once per step and device, against pools of ``num_pages`` pages (the kernels
        read pools unchecked)."""
        key = ("kernel", device)
        if key not in self._on_device:
            table, page_pos = self.live_pages()
            q_pos = torch.arange(self.past, self.num_tokens).expand(table.shape[0], -1)
            table = table.int() if device.type == "cuda" else table.long()
            index = tuple(t.to(device).contiguous() for t in (table, page_pos, q_pos))
            mark_checked(*index, num_pages)
            self._on_device[key] = index
        return self._on_device[key]

    def live_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pages [B, Nk], first-token positions [B, Nk]) of the rows' live pages, -1 padded."""
        if self.read_table is not None:
            return self.read_table, self.read_pos
        B, N = self.table.shape
        return self.table, (self.first_pos + torch.arange(N) * self.page_size).expand(B, N)

    def add_usage(self, page_mass: torch.Tensor) -> None:
        """Add one layer's attention mass per live page [B, Nk] to this step's usage."""
        page_mass = page_mass.float()  # stays on its device: moved to the host once, at commit
        self.usage = page_mass if self.usage is None else self.usage + page_mass.to(self.usage.device)

    def on(self, device: torch.device) -> "StepPlan":
        """This plan's index tensors on ``device``, moved once per step per device."""
        if device.type == "cpu":
            return self
        moved = self._on_device.get(device)
        if moved is None:
            move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
            moved = dataclasses.replace(self, table=move(self.table), slots=move(self.slots), copy_src=move(self.copy_src),
                                        copy_dst=move(self.copy_dst), read_table=move(self.read_table),
                                        read_pos=move(self.read_pos), usage=None, _on_device={})
            self._on_device[device] = moved
        return moved


class PageGroup:
    """Rows' page tables for one group of layers, all rows advancing in lockstep."""

    def __init__(self, manager: BlockManager, sliding_window: int | None = None,
                 policy: EvictionPolicy | None = None):
        self.manager = manager
        self.policy = policy or EvictionPolicy("error")
        self.tracks_usage = self.policy.tracks_usage and manager.max_pages is not None
        self.clock = 0  # steps planned so far
        self.usage = PageUsage()  # what the policy has observed of the pages' attention
        self._compress_to: int | None = None  # the bound to cut to once a compressed prompt's step commits
        self.page_size = manager.page_size
        self.sliding_window = sliding_window
        self.rows: list[list[int]] = []
        self.first_page = 0
        self.num_tokens = 0
        self.record_past = False  # set by assisted decoding: keep pages until `crop`
        self.step: StepPlan | None = None
        self._undo: tuple | None = None  # (rows, first_page, num_tokens) before an uncommitted step
        self._pending_release: list[int] = []
        self.layers = weakref.WeakSet()  # PagedLayers of this group (weak: a dropped cache frees its pages)
        self.evictions = 0  # live pages dropped by a lossy eviction policy
        self.prefix_hits = 0  # pages reused from the prefix cache instead of recomputed
        self.hashed_pages = 0  # logical pages [0, hashed_pages) of every row carry content hashes
        self.exact_tokens = math.inf  # tokens computed before the first eviction (they match a full forward)

    # ----------------------------------------------------------------- views
    def _window_page(self, past: int, first_page: int) -> int:
        """First logical page the window of a step starting after ``past`` tokens needs (rows start at ``first_page``)."""
        if self.sliding_window is None:
            return first_page
        return max(first_page, max(0, past - self.sliding_window + 1) // self.page_size)

    def first_kept_page(self, past: int, first_page: int | None = None) -> int:
        """First logical page a step starting after ``past`` tokens keeps (all of them while recording the past)."""
        first_page = self.first_page if first_page is None else first_page
        return first_page if self.record_past else self._window_page(past, first_page)

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
        twin.usage, twin.clock = self.usage, self.clock
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
        for layer in self.layers:
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

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if cropping would need tokens this group no longer holds."""
        new_len = self.num_tokens - tokens_to_remove
        if tokens_to_remove <= 0:
            return
        needed_from = max(0, new_len - self.sliding_window + 1) if self.sliding_window else new_len
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

    def _trim_recorded_past(self) -> None:
        """After a crop, free the sliding-window pages kept for it (see `record_past`)."""
        if not self.record_past:
            return
        trim = self._window_page(self.num_tokens, self.first_page) - self.first_page
        for r in self.rows:
            self.manager.release_row(r[:trim])
            del r[:trim]
        self.first_page += trim

    # ------------------------------------------------------------------ step
    def begin_step(self, batch_size: int, q_len: int, same_as: list[int] | None = None) -> StepPlan:
        """Allocate pages for ``q_len`` new tokens per row and plan the writes.

        ``same_as[b] = a`` (a <= b) says rows a and b of a fresh batch hold identical tokens (as
        when generate repeats a prompt for beams or samples): row b then shares row a's pages.

        Raises (changing nothing) when the batch size differs from the cached rows or a
        bounded pool cannot provide the pages.
        """
        self._finish_or_rollback()
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
        S, past, end = self.page_size, self.num_tokens, self.num_tokens + q_len
        fresh = not self.rows
        rows = self.rows if self.rows else [[] for _ in range(batch_size)]
        same_as = same_as if fresh and same_as and any(a != b for b, a in enumerate(same_as)) else None
        owners = [b for b in range(batch_size) if same_as is None or same_as[b] == b]
        new_first = self.first_kept_page(past)
        trim = new_first - self.first_page
        end_page = math.ceil(end / S)
        new_per_row = end_page - (self.first_page + len(rows[0]))
        partial = past % S != 0 and past > 0
        cow_rows = [b for b, r in enumerate(rows) if partial and self.manager.ref[r[-1]] > 1]
        needed = len(owners) * new_per_row + len(cow_rows)
        if self.policy.compress_prompt and fresh and self.manager.max_pages is not None and \
                needed > self.manager.available():  # the prompt goes in whole, then is cut (see `_compress`)
            self._compress_to, self.manager.max_pages = self.manager.max_pages, None
        elif self.policy.lossy and needed > self.manager.available():
            self._evict(needed)
        self.manager.require(needed, self.policy.lossy)

        # From here on nothing raises (the pool was checked above). Pages leaving the rows are
        # released only when the step commits, so that `abort_step` can restore them.
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
        self._allocate([rows[b] for b in owners], new_per_row)
        for b, a in enumerate(same_as or ()):
            if a != b:
                rows[b] = list(rows[a])
                self.manager.share_row(rows[b])
        self.rows = rows
        self.num_tokens = end
        self.step = self._plan(batch_size, q_len, past, src, dst, same_as)
        if was_slab and self.step.slab is None and self._relocate(rows, src, dst):
            self.step = self._plan(batch_size, q_len, past, src, dst, same_as)
        return self.step

    def _plan(self, batch_size, q_len, past, src, dst, same_as) -> StepPlan:
        S = self.page_size
        self.clock += 1
        table = torch.tensor(self.rows, dtype=torch.long)
        pos = torch.arange(past, self.num_tokens)
        written = table[:, pos // S - self.first_page]
        slots = (written * S + pos % S).reshape(-1)
        read_table = read_pos = None
        if self.tracks_usage or bool((table == EVICTED).any()):
            self.usage.written(written.unique().tolist(), self.clock)
            self.usage.allocated(table[:, pos[pos % S == 0] // S - self.first_page].unique().tolist(), self.clock)
            live = [[(p, (self.first_page + i) * S) for i, p in enumerate(r) if p != EVICTED] for r in self.rows]
            width = max(len(r) for r in live)
            read_table = torch.tensor([[p for p, _ in r] + [EVICTED] * (width - len(r)) for r in live])
            read_pos = torch.tensor([[q for _, q in r] + [self.num_tokens] * (width - len(r)) for r in live])
        return StepPlan(
            batch_size, q_len, past, self.num_tokens, self.first_page * S, table, slots,
            torch.tensor(src, dtype=torch.long) if src else None,
            torch.tensor(dst, dtype=torch.long) if dst else None,
            self._slab(table) if read_table is None else None, S, same_as, read_table, read_pos,
        )

    def usage_sink(self):
        """Where attention adds a layer's mass per live page ``[B, H, Nk]`` this step, or None when the
        policy does not track usage (see `PagedView.usage`)."""
        if not self.tracks_usage:
            return None
        plan, signal = self.step, self.policy.page_signal
        return lambda page_mass: plan.add_usage(signal(page_mass))

    def _record_usage(self) -> None:
        """Hand the last step's attention per page to the policy (once)."""
        plan = self.step
        if plan is None or plan.usage is None:
            return
        self.policy.record(self.usage, plan.read_table, plan.usage, self.clock)
        plan.usage = None

    def _compress(self) -> None:
        """After a prompt prefilled whole (``compress_prompt``): evict down to the bound, by the
        attention of the prompt's last queries. The pool keeps the prompt's size (its peak)."""
        self.manager.max_pages, self._compress_to = self._compress_to, None
        self._evict(0)

    def _evict(self, needed: int) -> None:
        """Drop live pages per the policy, round-robin over rows, until ``needed`` pages are free."""
        warn_first_eviction(self.policy, self.manager.max_pages)
        self.exact_tokens = min(self.exact_tokens, self.num_tokens)  # later tokens see fewer: not reusable
        while self.manager.available() < needed:
            evicted = False
            for row in self.rows:
                i = self.policy.victim(row, self.first_page, self.usage)
                if i is None:
                    continue
                self.manager.release(row[i])
                row[i] = EVICTED
                self.evictions += 1
                evicted = True
                if self.manager.available() >= needed:
                    return
            if not evicted:
                return  # everything left is protected: `require` raises with the numbers

    def unshare(self, rows: list[int]) -> list[tuple[int, int]]:
        """Give rows that were assumed identical to another row their own pages, mid-step.

        Returns the (source, copy) page pairs that layers which already wrote this step must
        copy (their content was identical); the step's plan is rebuilt for the other layers.
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
        self.step = self._plan(plan.batch_size, plan.q_len, plan.past, [], [], same_as)
        return pairs

    def _allocate(self, rows: list[list[int]], count: int) -> None:
        """Give each row ``count`` more pages, keeping a row's pages consecutive when possible.

        A fresh batch of several rows is placed on a slab (row b starts at ``base + b * stride``,
        with 25% headroom per row), so that decode can keep growing each row into its own region.
        """
        if count <= 0:
            return
        if all(not r for r in rows):
            stride = count + (count // 4 + 1 if len(rows) > 1 else 0)
            base = self.manager.free_run(len(rows) * stride)
            if base is not None:
                for b, r in enumerate(rows):
                    r.extend(self.manager.allocate(base + b * stride + i) for i in range(count))
                return
        for r in rows:
            for _ in range(count):
                r.append(self.manager.allocate(r[-1] + 1 if r else None))

    def _relocate(self, rows: list[list[int]], src: list[int], dst: list[int]) -> bool:
        """Move rows that outgrew their slab region onto a new slab with 25% more room per row.

        Like a vector's growth: each move copies the cache once and adds 25% room, so the
        cost per token is amortised, and decode keeps reading views instead of gathering.
        Only unshared rows of an unbounded pool move (a shared page stays shared); returns
        whether they moved.
        """
        if self.manager.max_pages is not None or any(p == EVICTED or self.manager.ref[p] != 1 for r in rows for p in r):
            return False
        stride = len(rows[0]) + len(rows[0]) // 4 + 1
        base = self.manager.free_run(len(rows) * stride)
        copied_from = dict(zip(dst, src))  # a page copied on write this step moves from its source
        for b, r in enumerate(rows):
            moved = [self.manager.allocate(base + b * stride + i) for i in range(len(r))]
            src.extend(copied_from.get(p, p) for p in r), dst.extend(moved)
            self._pending_release.extend(r)
            r[:] = moved
        return True

    @staticmethod
    def _slab(table: torch.Tensor) -> tuple[int, int] | None:
        """(base, stride) if ``table[b, i] == base + b * stride + i`` for all rows, else None."""
        B, n = table.shape
        if n == 0:
            return None
        if n > 1 and not bool((table[:, 1:] - table[:, :-1] == 1).all()):
            return None
        base = int(table[0, 0])
        if B == 1:
            return base, n
        stride = int(table[1, 0]) - base
        if stride < n or not bool((table[:, 0] == base + stride * torch.arange(B)).all()):
            return None
        return base, stride

    @property
    def step_open(self) -> bool:
        """A step was planned and is not yet committed or rolled back."""
        return self._undo is not None

    def step_complete(self) -> bool:
        """Every layer of the group wrote the tokens of the last planned step."""
        return all(layer.seen == self.num_tokens for layer in self.layers)

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
        self._record_usage()
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
        for layer in self.layers:
            layer.seen = min(layer.seen, old_tokens)
        self.step, self._undo, self._pending_release = None, None, []
        if self._compress_to is not None:  # nothing is held any more: only the bound comes back
            self.manager.max_pages, self._compress_to = self._compress_to, None
