"""`PageGroups`: the page groups of one `PagedCache`, keyed by sliding window (None: full attention).

A step of the cache spans every group: it is final only when every member layer of every group
wrote it, and a failed step rolls back in all of them together. Row edits (remap, crop, prefix
restore, release) apply to every group or, when one group cannot take them, to none.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .block_manager import BlockManager
from .errors import CacheUsageError
from .eviction import EvictionPolicy
from .page_group import PageGroup
from .page_store import PageStore


class PageGroups(dict):
    """Every page group of a cache; a dict by sliding window (and layer, per-layer eviction), with the
    operations that span them all."""

    def for_layer(self, sliding_window: int | None, layer_idx: int, page_size: int, max_pages: int | None,
                  policy: EvictionPolicy, per_layer: bool) -> PageGroup:
        """The group of a layer, made on first use: the layers of one sliding window share one, or each layer
        has its own when it chooses its own victims (``per_layer``, keyed ``(window, layer)``)."""
        key = (sliding_window, layer_idx) if per_layer else sliding_window
        if key not in self:
            self[key] = PageGroup(BlockManager(page_size, max_pages), sliding_window, policy)
        return self[key]

    def keep(self, groups: set[int]) -> None:
        """Drop the groups whose ``id`` is not in ``groups`` (another model's, after `bind_config`); the others' pages
        start anew in a store of their own (the layers are new: another model's keys may have other shapes; a
        fork keeps the store it shares)."""
        for key in [k for k, g in self.items() if id(g) not in groups]:
            del self[key]
        for group in self.values():
            group.store = PageStore(group.page_size)

    @property
    def step_open(self) -> bool:
        """Some group planned a step that is not yet committed or rolled back."""
        return any(g.step_open for g in self.values())

    def step_failed(self, group: PageGroup | None = None) -> bool:
        """The last step never reached every layer: some group's layers did not all write it, or some group
        never began it (groups begin a step in layer order). With ``group``: as a layer of ``group`` about to
        start new tokens sees it."""
        if group is not None:
            return (group.step_open and not group.step_complete()) or min(self.token_counts()) < group.num_tokens
        return len(self.token_counts()) > 1 or any(g.step_open and not g.step_complete() for g in self.values())

    def level_with(self, group: PageGroup) -> bool:
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
        forward's."""
        self._record_together()
        for group in self.values():
            group.commit()
        if row_hashes is None:
            return
        exact = min((g.eviction.exact_tokens for g in self.values()), default=math.inf)
        for group in self.values():
            group.register_hashes(row_hashes if exact == math.inf else
                                  [h[:exact // group.page_size] for h in row_hashes])

    def _record_together(self) -> None:
        """Record the step of every group that ranks its pages by their last share (per-layer "score" groups with
        no decay, `EvictionPolicy.ranks_by_last_share`) and pick their next victims, in one pass over all their
        live tables: a row's shares and victim depend on its row only. The victims are the live columns
        `GroupEviction.recycle` evicts if the next step recycles."""
        picking = [g for g in self.values() if g.eviction.tracks_usage and g.policy.ranks_by_last_share
                   and g.step is not None and g.step.usage is not None]
        plans = [g.step for g in picking]
        if len(plans) < 2 or len({(p.read_table.shape, p.num_tokens, p.page_size, p.usage.device, g.policy)
                                  for g, p in zip(picking, plans)}) > 1:
            return  # (each group records its own step when it commits)
        policy, tables = picking[0].policy, np.concatenate([p.read_table.numpy() for p in plans])
        shares = policy.whole_shares(tables, torch.cat([p.usage for p in plans]))
        if shares is None:
            return
        for group, plan, pages, plan_shares in zip(picking, plans, np.split(tables, len(plans)),
                                                   np.split(shares, len(plans))):
            policy.fold_last_shares(group.eviction.history, pages, plan_shares)
            plan.usage, plan.shares = None, plan_shares
        columns = policy.victim_columns(None, np.concatenate([p.read_pos.numpy() for p in plans]), None,
                                        plans[0].page_size, plans[0].num_tokens, shares)
        for plan, victims in zip(plans, np.split(columns, len(plans)) if columns is not None else ()):
            plan.victims = victims

    def rollback(self) -> None:
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

    def fork(self) -> "PageGroups":
        return PageGroups({w: g.fork() for w, g in self.items()})

    def set_max_pages(self, max_pages: int | None) -> None:
        """Bound every group's pool (None: unbounded); raises, changing nothing, below what a group holds."""
        held = max((g.manager.num_used for g in self.values()), default=0)
        if max_pages is not None and max_pages < held:
            raise CacheUsageError(f"set_max_pages({max_pages}): a layer group holds {held} pages; evict by "
                                  "generating within the old bound, or reset() first.")
        for group in self.values():
            group.manager.max_pages = max_pages

    def stats(self) -> dict:
        """Page accounting summed over the groups, and the K/V bytes of their layers' used + cached pages
        (``kv_bytes``) and pools (``pool_bytes``); ``tokens_held``: the most tokens one group holds (what
        max_pages bounds)."""
        out = dict(pages_total=0, pages_used=0, pages_free=0, pages_cached=0, tokens_stored=0, kv_bytes=0,
                   pool_bytes=0, evictions=0, prefix_hits=0)
        for group in self.values():
            m = group.manager
            for key, value in dict(pages_total=m.num_pages, pages_used=m.num_used, pages_free=len(m.free),
                                   pages_cached=len(m.cached), tokens_stored=group.tokens_stored(),
                                   evictions=group.eviction.evictions, prefix_hits=group.prefix_hits).items():
                out[key] += value
            out["kv_bytes"] += (m.num_used + len(m.cached)) * group.store.page_bytes()
            out["pool_bytes"] += group.store.pool_bytes()
        out["tokens_held"] = self.tokens_held()
        return out

    def tokens_held(self) -> int:
        """The most tokens one group holds, counted as they are (an open step's included: nothing commits)."""
        return max((g.tokens_stored() for g in self.values()), default=0)
