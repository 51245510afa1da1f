"""Layer groups: the pages of the layers that keep the same tokens, and the steps that span every group of a cache.

A forward step is planned once per group, by the first member layer that writes it, and reused
by every other member (`StepPlan`, in `step_plan`). `LayerGroup.begin_step` checks the step, reserves its
pages (evicting per the policy, `eviction.GroupEviction`, when a bounded pool is full), then
applies it to the rows (`PageRows`); until the step commits, the pages it replaced are held so
that `abort_step` can restore the rows (`StepUndo`). The group counts the tokens each member wrote (`Members`):
a step is complete when every member wrote it.

A step of the cache spans every group (`LayerGroups`, keyed by sliding window; None: full attention): it is
final only when every member layer of every group wrote it, and a failed step rolls back in all of them
together. Row edits (remap, crop, prefix restore, release) apply to every group or, when one group cannot take
them, to none.
"""

from __future__ import annotations

import math
import weakref

from .attention import PagedView
from .block_manager import BlockManager
from .demotion import make_manager, tier_stats
from .errors import CacheUsageError
from .eviction import EvictionPolicy, GroupEviction, plan_stacked, record_together
from .page_store import PageStore
from .page_tables import PageRows, StepUndo, copy_on_write, needs_copy
from .step_plan import StepPlan, build_plan, continue_plan, continues, place_rows, relocate_rows


class Members:
    """The layers of a group (held weakly: a dropped cache frees its pages) and the tokens each has written, kept on
    the layer as ``tokens_written`` (a layer is a member of one group, its own). ``_level``: a count that every member
    wrote, or None when unknown (a member dropped leaves it true; a group of one layer, per-layer eviction's, knows
    it)."""

    def __init__(self):
        self._layers = weakref.WeakSet()
        self._level: int | None = None

    def __iter__(self):
        return iter(list(self._layers))

    def join(self, layer, tokens: int = 0) -> None:
        """``layer`` is a member, having written ``tokens`` tokens."""
        self._layers.add(layer)
        self.wrote(layer, tokens)

    def wrote(self, layer, tokens: int) -> None:
        """``layer``, a member, has written ``tokens`` tokens."""
        layer.tokens_written = tokens
        if tokens != self._level:
            self._level = tokens if len(self._layers) == 1 else None  # (unknown: `all_at` counts again)

    def set_all(self, tokens: int) -> None:
        for layer in list(self._layers):
            layer.tokens_written = tokens
        self._level = tokens

    def cap(self, tokens: int) -> None:
        """No member holds more than ``tokens`` tokens (a step rolled back)."""
        for layer in list(self._layers):
            layer.tokens_written = min(layer.tokens_written, tokens)
        self._level = None if self._level is None else min(self._level, tokens)

    def all_at(self, tokens: int) -> bool:
        if self._level is None:
            counts = {layer.tokens_written for layer in list(self._layers)}
            self._level = counts.pop() if len(counts) == 1 else None
        return self._level == tokens or not self._layers

    def at(self, tokens: int) -> list:
        """The members that wrote exactly ``tokens`` tokens."""
        return [layer for layer in list(self._layers) if layer.tokens_written == tokens]


class LayerGroup(PageRows):
    """Rows' pages for one group of layers, all rows advancing in lockstep, one step at a time."""

    def __init__(self, manager: BlockManager, sliding_window: int | None = None,
                 policy: EvictionPolicy | None = None, prefix=None, kv_format: str = "float"):
        super().__init__(manager, sliding_window, prefix)
        self.policy = policy or EvictionPolicy("error")
        self.eviction = GroupEviction(self.policy, True) if manager.max_pages is not None else None  # (bounded only)
        self.step: StepPlan | None = None
        self._undo: StepUndo | None = None  # set while a step is open
        self.members = Members()
        self.store = PageStore(manager.page_size, kv_format, manager)  # the K/V bytes of its page ids (forks share)
        self.prefix.store = self.prefix.store or self.store

    def read_view(self, pages, plan: StepPlan, backend: str) -> PagedView:  # a member's, this step (plan on its device)
        return PagedView(pages, plan, backend, self.eviction and self.eviction.probe(self.step))

    def __del__(self):  # a dropped cache (or fork) gives its pages back: unreferenced, then cached or free
        try:
            self.clear()
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass

    # ----------------------------------------------- row edits (between steps)
    def fork(self) -> "LayerGroup":
        """A group with the same rows, sharing every page (one more reference each)."""
        self.commit()
        twin = LayerGroup(self.manager, self.sliding_window, self.policy, self.prefix)
        twin.store = self.store
        twin.eviction = None if self.eviction is None else self.eviction.fork(self.manager.max_pages is not None)
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
        self.step = None
        if self.eviction is not None:
            self.eviction.exact_tokens = math.inf
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
        return layer.tokens_written == self.num_tokens

    def wrote(self, layer) -> None:
        """``layer`` wrote the tokens of the current step."""
        self.members.wrote(layer, self.num_tokens)

    def join_step(self, layer, batch_size: int, q_len: int, identical_rows) -> StepPlan:
        """The plan of the step ``layer`` writes now: the group plans it when the layer is the first member
        to write new tokens (``identical_rows()`` then tells which rows of a fresh batch may share pages).
        Raises when the layer's tokens are not those of the planned step."""
        if self.up_to_date(layer):
            fresh_batch = self.num_tokens == 0 and not self.rows and batch_size > 1
            return self.begin_step(batch_size, q_len, identical_rows() if fresh_batch else None)
        if self.step is None or layer.tokens_written + q_len != self.num_tokens or batch_size != self.step.batch_size:
            raise CacheUsageError(
                f"layer {layer.layer_idx} received {q_len} token(s) for a batch of {batch_size}, but its group planned "
                f"a step of {self.step.q_len if self.step else 0} token(s) for {self.batch_size} row(s): every layer "
                "must see the same tokens in the same step. (An encoder-decoder model such as T5 or BART gives the "
                "cache its cross-attention keys too: PagedCache supports decoder-only models only.)")
        return self.step

    # ------------------------------------------------------------------ step
    def begin_step(self, batch_size: int, q_len: int, same_as: list[int] | None = None) -> StepPlan:
        """Allocate pages for ``q_len`` new tokens per row and plan the writes.

        ``same_as[b] = a`` (a <= b) says rows a and b of a fresh batch hold identical tokens (as when generate repeats
        a prompt for beams or samples): row b then shares row a's pages. Raises (changing nothing) when the batch size
        differs from the cached rows or a bounded pool cannot provide the pages."""
        self._finish_or_rollback()
        self.check_batch(batch_size)
        if self.first_kept_page(self.num_tokens) == self.first_page and not self.manager.overdrawn:
            quick = self.begin_planned(self._quick_plan, q_len)
            if quick is not None:  # the common decode steps
                return quick
        S, past = self.page_size, self.num_tokens
        fresh = not self.rows
        rows = self.rows if self.rows else [[] for _ in range(batch_size)]
        same_as = same_as if fresh and same_as and any(a != b for b, a in enumerate(same_as)) else None
        owners = [b for b in range(batch_size) if same_as is None or same_as[b] == b]
        new_per_row = math.ceil((past + q_len) / S) - (self.first_page + len(rows[0]))
        cow_rows = [b for b, r in enumerate(rows) if needs_copy(self.manager, r, past)]
        if self.eviction is not None:  # (an unbounded pool always has room)
            self.eviction.reserve(self.manager, self.rows, self.first_page, past,
                                  len(owners) * new_per_row + len(cow_rows), fresh, self.step)
        return self._apply(rows, q_len, owners, new_per_row, cow_rows, same_as)

    def begin_planned(self, plan_rows, *args, stacked: bool = False) -> StepPlan | None:
        """Begin a step that keeps the rows' tables: ``plan_rows(*args)`` plans it, only appending pages to the rows
        (a decode step's quick plans; `eviction.plan_stacked` plans every group's at once), or returns None."""
        undo = self._step_undo(appends_only=True)  # (a recycled step's evictions are final: not undone)
        plan = plan_rows(*args)
        if plan is not None:
            self._undo, self.num_tokens, self.step = undo, plan.num_tokens, plan
            if self.eviction is not None:
                self.eviction.planned(plan, written=stacked)  # (stacked: the stack noted every group's writes)
        return plan

    def _quick_plan(self, q_len: int) -> StepPlan | None:
        quick = continue_plan(self.step, self.rows, q_len, self.manager.ref)  # the tables stay as they are
        return quick if quick is not None or self.eviction is None else self.eviction.recycled_step(
            self.manager, self.rows, self.num_tokens, q_len, self.step)

    def _step_undo(self, appends_only: bool = False) -> StepUndo:  # the rows, their first page and length
        return StepUndo(self.rows, appends_only, (self.first_page, self.num_tokens))

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
        eviction = self.eviction
        plan = None if src or same_as or eviction is None else eviction.extended_step(
            self.rows, self.first_page, past, self.num_tokens, self.step)
        plan = plan or build_plan(self.rows, self.first_page, past, self.num_tokens, self.page_size, src, dst, same_as,
                                  eviction is not None and eviction.tracks_usage)
        if eviction is not None:
            eviction.planned(plan)
        return plan

    def unshare(self, rows: list[int]) -> None:
        """Give rows that were assumed identical to another row their own pages, mid-step: members that already
        wrote this step copy the shared pages to the new ones; the step's plan is rebuilt for the other members."""
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
        if self._undo is not None:
            (self.commit if self.step_complete() else self.abort_step)()

    def commit(self) -> None:
        """Make the current step final: release the pages it replaced or trimmed."""
        if self.eviction is not None:
            self.eviction.record(self.step)
        if self._undo is None:
            return
        self._undo.commit(self.manager)
        self._undo = None
        if self.eviction is not None:
            self.eviction.committed(self.manager, self.rows, self.first_page, self.num_tokens, self.step)

    def abort_step(self) -> None:
        """Undo the current step: pages it allocated are released, tables restored."""
        if self._undo is None:
            return
        if self.eviction is not None:
            self.eviction.hold_queue(self.step)
        self._undo.rollback(self.manager, self.rows)
        self.rows, (self.first_page, self.num_tokens) = self._undo.tables, self._undo.state
        self.members.cap(self.num_tokens)
        self.step, self._undo = None, None
        self.manager.overdraw(False)  # (a compressed prompt's step: nothing is held any more, the bound holds again)


class LayerGroups(dict):
    """Every page group of a cache; a dict by sliding window (and layer, per-layer eviction), with the
    operations that span them all. ``stack``: the `eviction.PlanStack` that planned the open (or last) step of
    every group at once, None when each group planned its own."""

    stack = None

    def for_layer(self, sliding_window: int | None, layer_idx: int, page_size: int, max_pages: int | None,
                  policy: EvictionPolicy, per_layer: bool, kv_format: str = "float",
                  cold_format: str | None = None) -> LayerGroup:
        """The group of a layer, made on first use: the layers of one sliding window share one, or each layer
        has its own when it chooses its own victims (``per_layer``, keyed ``(window, layer)``); its pages in
        ``kv_format`` (with a ``cold_format``, a byte budget that demotes pages first: `hf_paged.demotion`)."""
        key = (sliding_window, layer_idx) if per_layer else sliding_window
        if key not in self:
            self[key] = LayerGroup(make_manager(page_size, max_pages, cold_format), sliding_window, policy,
                                   kv_format=kv_format)
        return self[key]

    def keep(self, groups: set[int]) -> None:
        """Drop the groups whose ``id`` is not in ``groups`` (another model's, after `bind_config`); the others' pages
        start anew in a store of their own (the layers are new: another model's keys may have other shapes; a
        fork keeps the store it shares)."""
        for key in [k for k, g in self.items() if id(g) not in groups]:
            del self[key]
        for group in self.values():
            group.store = group.prefix.store = PageStore(group.page_size, group.store.kv_format, group.manager)

    def demote_filled(self) -> None:
        """Once a step of the cache is final: each group with a cold format and no budget demotes the full pages its
        rows hold hot past their sinks (`demotion.ColdPages.demote_filled`)."""
        for g in self.values():
            if g.manager.cold is not None and g.manager.max_pages is None:
                g.manager.cold.demote_filled(g.manager, g.rows, g.first_page, g.num_tokens, g.policy.sink_pages)

    def plan_together(self, batch_size: int, q_len: int) -> None:
        """Plan a new step of ``batch_size`` rows and ``q_len`` tokens for every group at once when they are per-layer
        groups of bounded pools in a steady state (`eviction.plan_stacked`: one plan per step, where each group
        would plan its own as its first layer writes; every group then begins the step with the first layer)."""
        groups = list(self.values())
        if self.stack is not None and self.stack.steady(groups, batch_size, q_len):  # (it planned the last step too)
            self.stack = plan_stacked(groups, self.stack, q_len, continuing=False, steady=True)
            return
        together = len(groups) > 1 and all(
            g.eviction is not None and not g.step_open and len(g.rows) == batch_size and not g.manager.overdrawn
            and g.first_kept_page(g.num_tokens) == g.first_page for g in groups)
        continuing = together and all(continues(g.step, g.rows, q_len, g.manager.ref) for g in groups)
        self.stack = plan_stacked(groups, self.stack, q_len, continuing) if together else None

    @property
    def step_open(self) -> bool:
        """Some group planned a step that is not yet committed or rolled back."""
        return any(g.step_open for g in self.values())

    def step_failed(self, group: LayerGroup | None = None) -> bool:
        """The last step never reached every layer: some group's layers did not all write it, or some group
        never began it (groups begin a step in layer order). With ``group``: as a layer of ``group`` about to
        start new tokens sees it (after a step planned together, every group began it: some group's layer did not
        write it)."""
        if group is not None:
            return ((group.step_open and not group.step_complete()) or min(self.token_counts()) < group.num_tokens
                    or (self.stack is not None and any(g.step_open and not g.step_complete() for g in self.values())))
        return len(self.token_counts()) > 1 or any(g.step_open and not g.step_complete() for g in self.values())

    def level_with(self, group: LayerGroup) -> bool:
        """Every group holds as many tokens as ``group``: none has begun a step that ``group`` has not (mid-step, the
        first group, which began it, tells)."""
        return all(g.num_tokens == group.num_tokens for g in self.values())

    def token_counts(self) -> set[int]:
        """The tokens the groups hold (one count when they are level)."""
        return {g.num_tokens for g in self.values()}

    @property
    def num_tokens(self) -> int:
        """Tokens every group holds (committed, or planned by an open step)."""
        return next(iter(self.values())).num_tokens if self else 0

    def commit(self, row_hashes: list[list[bytes]] | None = None) -> None:
        """Make every group's step final, then give full pages their content hashes (``row_hashes``, per row),
        but not pages computed after an eviction in any group: every layer's later K/V differ from a full
        forward's; then demote the pages filled (`demote_filled`)."""
        groups = list(self.values())
        if any(group.eviction is not None for group in groups) and record_together(groups, self.stack):
            for group in groups:  # (the stack's step, recorded: it released nothing, no group is overdrawn)
                group._undo = None
        else:
            for group in groups:
                group.commit()
        if row_hashes is not None:
            exact = min((g.eviction.exact_tokens for g in self.values() if g.eviction is not None), default=math.inf)
            for group in self.values():
                hashes = row_hashes if exact == math.inf else [h[:exact // group.page_size] for h in row_hashes]
                group.register_hashes(hashes, generated=group.step is not None and group.step.q_len == 1)
        self.demote_filled()

    def rollback(self) -> None:
        self.stack = None  # (the next step begins group by group, as every group's rows lost their plan)
        for group in self.values():
            group.abort_step()

    def restore_prefix(self, row_hashes: list[list[bytes]], pages: int) -> int:
        """Share the cached pages of the longest prefix of at most ``pages`` full pages that every group
        still finds; returns its length in pages (0: nothing restored)."""
        while pages > 0 and not all(g.can_restore(row_hashes, pages) for g in self.values()):
            pages -= 1
        for group in self.values() if pages else ():
            group.restore(row_hashes, pages)
        return pages

    def remap(self, rows_for) -> None:
        for group in self.values():
            group.remap(rows_for)

    def crop(self, tokens_to_remove: int) -> None:
        for group in self.values():  # all groups are checked before any is cropped
            group.check_crop(tokens_to_remove)
        for group in self.values():
            group.crop(tokens_to_remove)

    def clear(self) -> None:
        for group in self.values():
            group.clear()

    def fork(self) -> "LayerGroups":
        return LayerGroups({w: g.fork() for w, g in self.items()})

    def set_max_pages(self, max_pages: int | None) -> None:
        """Bound every group's pool (None: unbounded); raises, changing nothing, below what a group holds."""
        held = max((g.manager.num_used for g in self.values()), default=0)
        if max_pages is not None and max_pages < held:
            raise CacheUsageError(f"set_max_pages({max_pages}): a layer group holds {held} pages; evict by "
                                  "generating within the old bound, or reset() first.")
        for group in self.values():
            group.manager.set_bound(max_pages)
            if max_pages is not None and group.eviction is None:  # (made unbounded: it observed no usage)
                group.eviction = GroupEviction(group.policy, bounded=False)

    def stats(self) -> dict:
        """Page accounting summed over the groups, and the K/V bytes of their layers' used + cached pages
        (``kv_bytes``) and pools (``pool_bytes``); ``tokens_held``: the most tokens one group holds (what
        max_pages bounds); with a cold format, ``pages_cold`` and ``demotions`` (`demotion.tier_stats`)."""
        out = dict(pages_total=0, pages_used=0, pages_free=0, pages_cached=0, tokens_stored=0, kv_bytes=0,
                   pool_bytes=0, evictions=0, prefix_hits=0)
        for group in self.values():
            m = group.manager
            for key, value in dict(pages_total=m.num_pages, pages_used=m.num_used, pages_free=len(m.free),
                                   pages_cached=len(m.cached), tokens_stored=group.tokens_stored(),
                                   evictions=group.eviction.evictions if group.eviction else 0,
                                   prefix_hits=group.prefix_hits).items():
                out[key] += value
            out["kv_bytes"] += group.store.held_bytes()
            out["pool_bytes"] += group.store.pool_bytes()
        out["tokens_held"] = self.tokens_held()
        for index in {id(g.prefix): g.prefix for g in self.values()}.values():  # listeners' counters (a prefix store)
            for key, value in index.stats().items():
                out[key] = out.get(key, 0) + value
        return {**out, **tier_stats(self.values())}

    def tokens_held(self) -> int:
        """The most tokens one group holds, counted as they are (an open step's included: nothing commits)."""
        return max((g.tokens_stored() for g in self.values()), default=0)
