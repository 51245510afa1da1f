"""`PageGroup`: the pages of one group of layers (layers that keep the same tokens) and its steps.

A forward step is planned once per group, by the first member layer that writes it, and reused
by every other member (`StepPlan`, in `step_plan`). `begin_step` checks the step, reserves its
pages (evicting per the policy, `eviction.GroupEviction`, when a bounded pool is full), then
applies it to the rows (`PageRows`); until the step commits, the pages it replaced are held so
that `abort_step` can restore the rows. The group counts the tokens each member wrote (`Members`):
a step is complete when every member wrote it.
"""

from __future__ import annotations

import math
import weakref

from .block_manager import BlockManager
from .errors import CacheUsageError
from .eviction import EvictionPolicy, GroupEviction
from .page_rows import PageRows
from .page_tables import StepUndo, copy_on_write, needs_copy
from .page_store import PageStore
from .paged_kv import PagedView
from .step_plan import (StepPlan, build_plan, continue_plan, extend_plan, place_rows, recycle_plan,
                        relocate_rows)


class Members:
    """The layers of a group and the tokens each has written (held weakly: a dropped cache frees its pages)."""

    def __init__(self):
        self._written = weakref.WeakKeyDictionary()

    def __iter__(self):
        return iter(list(self._written))

    def __getitem__(self, layer) -> int:
        return self._written[layer]

    def join(self, layer, tokens: int = 0) -> None:
        """``layer`` is a member, having written ``tokens`` tokens."""
        self._written[layer] = tokens

    def set_all(self, tokens: int) -> None:
        for layer in list(self._written):
            self._written[layer] = tokens

    def cap(self, tokens: int) -> None:
        """No member holds more than ``tokens`` tokens (a step rolled back)."""
        for layer, written in list(self._written.items()):
            self._written[layer] = min(written, tokens)

    def all_at(self, tokens: int) -> bool:
        return all(written == tokens for written in self._written.values())

    def at(self, tokens: int) -> list:
        """The members that wrote exactly ``tokens`` tokens."""
        return [layer for layer, written in list(self._written.items()) if written == tokens]


class PageGroup(PageRows):
    """Rows' pages for one group of layers, all rows advancing in lockstep, one step at a time."""

    def __init__(self, manager: BlockManager, sliding_window: int | None = None,
                 policy: EvictionPolicy | None = None):
        super().__init__(manager, sliding_window)
        self.policy = policy or EvictionPolicy("error")
        self.eviction = GroupEviction(self.policy, manager.max_pages is not None)
        self.step: StepPlan | None = None
        self._undo: StepUndo | None = None  # set while a step is open
        self.members = Members()
        self.store = PageStore(manager.page_size)  # the K/V bytes of this group's page ids, shared by forks

    def read_view(self, pages, backend: str) -> PagedView:
        """What attention reads of a member (its `LayerPages`) in the current step."""
        p = self.policy
        return PagedView(pages, self.step.on(pages.device), backend, self.eviction.usage_callback(self.step),
                         p.observation_window, p.heads, p.signal)

    def __del__(self):  # a dropped cache (or fork) gives its pages back: unreferenced, then cached or free
        try:
            self.clear()
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass

    # ----------------------------------------------- row edits (between steps)
    def fork(self) -> "PageGroup":
        """A group with the same rows, sharing every page (one more reference each)."""
        self.commit()
        twin = PageGroup(self.manager, self.sliding_window, self.policy)
        twin.store = self.store
        twin.eviction = self.eviction.fork(self.manager.max_pages is not None)
        self.share_into(twin)
        return twin

    def restore(self, row_hashes: list[list[bytes]], pages: int) -> None:
        super().restore(row_hashes, pages)
        self.members.set_all(self.num_tokens)

    def remap(self, rows_for) -> None:
        self.commit()
        if self.rows:  # an empty group has no rows to remap
            super().remap(rows_for)
            self.step = None

    def clear(self) -> None:
        """Release every row (tail first); the group is empty afterwards."""
        self.commit()
        super().clear()
        self.step, self.eviction.exact_tokens = None, math.inf
        self.members.set_all(0)

    def crop(self, tokens_to_remove: int) -> None:
        self.commit()
        super().crop(tokens_to_remove)
        if tokens_to_remove > 0:
            self.step = None
        self.members.set_all(self.num_tokens)

    # ------------------------------------------------------------ membership
    def up_to_date(self, layer) -> bool:
        """``layer`` wrote every token of the group (its next update starts a new step)."""
        return self.members[layer] == self.num_tokens

    def wrote(self, layer) -> None:
        """``layer`` wrote the tokens of the current step."""
        self.members.join(layer, self.num_tokens)

    def join_step(self, layer, batch_size: int, q_len: int, identical_rows) -> StepPlan:
        """The plan of the step ``layer`` writes now: the group plans it when the layer is the first member
        to write new tokens (``identical_rows()`` then tells which rows of a fresh batch may share pages).
        Raises when the layer's tokens are not those of the planned step."""
        if self.up_to_date(layer):
            fresh_batch = self.num_tokens == 0 and not self.rows and batch_size > 1
            return self.begin_step(batch_size, q_len, identical_rows() if fresh_batch else None)
        if self.step is None or self.members[layer] + q_len != self.num_tokens or batch_size != self.step.batch_size:
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
        self.check_batch(batch_size)
        if self.first_kept_page(self.num_tokens) == self.first_page and not self.eviction.compressing:
            quick = continue_plan(self.step, self.rows, q_len, self.manager.ref)  # the tables stay as they are
            self._undo = self._step_undo(appends_only=True) if quick is not None else None
            quick = quick or self._recycle(q_len)
            if quick is not None:  # the common decode steps
                self.num_tokens, self.step = quick.num_tokens, quick
                self.eviction.planned(quick)
                return quick
        S, past = self.page_size, self.num_tokens
        fresh = not self.rows
        rows = self.rows if self.rows else [[] for _ in range(batch_size)]
        same_as = same_as if fresh and same_as and any(a != b for b, a in enumerate(same_as)) else None
        owners = [b for b in range(batch_size) if same_as is None or same_as[b] == b]
        new_per_row = math.ceil((past + q_len) / S) - (self.first_page + len(rows[0]))
        cow_rows = [b for b, r in enumerate(rows) if needs_copy(self.manager, r, past)]
        self.eviction.reserve(self.manager, self.rows, self.first_page, past, len(owners) * new_per_row + len(cow_rows),
                              fresh, self.step)
        return self._apply(rows, q_len, owners, new_per_row, cow_rows, same_as)

    def _step_undo(self, appends_only: bool = False) -> StepUndo:  # the rows, their first page and length
        return StepUndo(self.rows, appends_only, (self.first_page, self.num_tokens))

    def _recycle(self, q_len: int) -> StepPlan | None:
        """A full pool's steady step (`GroupEviction.recycle`): each row's victim page takes its new tokens."""
        picks = self.eviction.recycle(self.manager, self.rows, self.num_tokens, q_len, self.step)
        if picks is None:
            return None
        self._undo = self._step_undo(appends_only=True)  # the evictions are final, the pages' new use is undone
        return recycle_plan(self.step, self.rows, *picks, q_len)

    def _apply(self, rows, q_len, owners, new_per_row, cow_rows, same_as) -> StepPlan:
        """Give the rows their new pages (nothing raises: the pool was reserved) and plan the step.

        Pages leaving the rows are released only when the step commits, so that `abort_step` can
        restore them.
        """
        past = self.num_tokens
        new_first = self.first_kept_page(past)
        trim = new_first - self.first_page
        self._undo = self._step_undo()
        self._undo.replaced = [p for r in rows for p in r[:trim]]
        for r in rows:
            del r[:trim]
        self.first_page = new_first
        src, dst = [], []
        for b in cow_rows:  # the row gets its own copy of the shared partial page
            src_page, dst_page = copy_on_write(self.manager, rows[b], past, self._undo)
            src.append(src_page), dst.append(dst_page)
        was_slab = self.step is not None and self.step.slab is not None
        place_rows(self.manager, [rows[b] for b in owners], new_per_row)
        for b, a in enumerate(same_as or ()):
            if a != b:
                rows[b] = list(rows[a])
                self.manager.share_row(rows[b])
        self.rows = rows
        self.num_tokens = past + q_len
        self.step = self._plan(past, src, dst, same_as)
        if was_slab and self.step.slab is None and relocate_rows(self.manager, rows, src, dst, self._undo.replaced):
            self.step = self._plan(past, src, dst, same_as)
        return self.step

    def _plan(self, past, src, dst, same_as) -> StepPlan:
        """The step's plan: the last one edited in place (evictions and new pages only), else built in full."""
        plan = None if src or same_as else extend_plan(self.step, self.rows, self.first_page, past, self.num_tokens,
                                                       self.eviction.evicted)
        plan = plan or build_plan(self.rows, self.first_page, past, self.num_tokens, self.page_size, src, dst, same_as,
                                  self.eviction.tracks_usage)
        self.eviction.planned(plan)
        return plan

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
        for layer in self.members.at(self.num_tokens):
            layer.copy_pages(pairs)  # it wrote the shared pages: their content is the rows' too

    @property
    def step_open(self) -> bool:  # a step was planned and is not yet committed or rolled back
        return self._undo is not None

    def step_complete(self) -> bool:  # every layer of the group wrote the tokens of the last planned step
        return self.members.all_at(self.num_tokens)

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
        self._undo.commit(self.manager)
        self._undo = None
        self.eviction.committed(self.manager, self.rows, self.first_page, self.num_tokens, self.step)

    def abort_step(self) -> None:
        """Undo the current step: pages it allocated are released, tables restored."""
        if self._undo is None:
            return
        self._undo.rollback(self.manager, self.rows)
        self.rows, (self.first_page, self.num_tokens) = self._undo.tables, self._undo.state
        self.members.cap(self.num_tokens)
        self.step, self._undo = None, None
        self.eviction.rolled_back(self.manager)
