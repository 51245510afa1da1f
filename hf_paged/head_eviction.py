"""Eviction per KV head (issue 34): each (row, KV head) of a layer keeps its own tokens, in one-token head pages.

With pages of one token, a layer's pool ``[P, 1, H, D]`` is a contiguous ``[P·H, 1, 1, D]``: one *head page* per
(token, KV head). A `HeadLayer` keeps a page table per (row, KV head), table row ``b·H + h`` (its slice of the
cache's stacked `HeadTables`, which plans a steady decode step for every layer at once), over its `HeadPool` of head
pages (ids from a `BlockManager`, bytes in one float `LayerPages` of the page store: one head, one token a page;
written with ``write``, read with ``gather`` or the kernel operands), and attention regroups the query
``[B, Hq, Q, D]`` as ``[B·H, Hq/H, Q, D]`` and runs the paged kernels unchanged (the C kernel, the Triton kernel,
SDPA on gathered pages, the float64 reference): one KV head a table row, ``Hkv = 1``. A head that needs few tokens
holds few pages; the pages it frees serve the other heads, rows and forks.

Budget: ``max_pages`` tokens per layer per row, i.e. ``max_pages × H`` head pages shared by the row's heads of the
layer. When a step would exceed it, the row gives up its lowest-scored head pages across its heads (the layer's
own usage signal, per KV head: the share of its attention, or of the output it moves, relative to an even share of
that head's pages), each head keeping at least ``head_floor × max_pages`` (AdaKV's safeguard) besides its sinks and
newest tokens. Victims are chosen before the step writes (the budget is never exceeded), except that with
``compress_prompt`` a step of several tokens is written whole and cut by its last queries' usage (SnapKV).
Invariants: a head page is free iff no table (of any fork) holds it; positions of kept tokens never change; a row's
tables hold ``≤ max_pages × H`` head pages between steps. A failed step is rolled back: its tokens go, the evictions
made to fit them stand (as for a per-layer bounded cache).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin
from transformers.utils import logging

from .attention import CPU_KERNEL_MAX_QUERIES, LayerRead, attend
from .backends import resolve_backend
from .block_manager import BlockManager
from .errors import CacheUsageError, PagePoolExhausted
from .eviction import EvictionPolicy, page_usage
from .kernels import cpu_paged_attention as cpu_kernel
from .page_store import make_layer_pages
from .page_tables import remember_kernel_index

logger = logging.get_logger(__name__)
HOLE = -1
DEFAULT_HEAD_FLOOR = 0.2  # AdaKV's alpha: each head keeps at least this share of an even split of the budget


def refuse_per_head(page_size: int, policy: EvictionPolicy, formats: tuple[str, str | None], model, prefix_store,
                    per_layer_eviction, head_floor) -> None:
    """Raise `CacheUsageError` for what per-head eviction cannot serve."""
    if page_size != 1:
        raise CacheUsageError(
            f"per_head_eviction needs page_size=1, got {page_size}: a layer's pool [P, S, H, D] is a pool of one-head "
            "pages [P·H, S, 1, D] only when S = 1 (with S > 1 a head's tokens are not contiguous), and a head can "
            "then drop single tokens. Use page_size=1, or per_head_eviction=False.")
    if policy.interval != 1:
        raise CacheUsageError(f"per_head_eviction chooses each step's victims: eviction_interval={policy.interval} "
                              "serves per_head_eviction=False.")
    if policy.name != "score":
        raise CacheUsageError(f"per_head_eviction ranks each head's tokens by their usage: it needs eviction='score', "
                              f"got {policy.name!r}. ('fifo' keeps the same tokens in every head.)")
    if formats != ("float", None):
        raise CacheUsageError(f"per_head_eviction keeps float pages only, got kv_format={formats[0]!r}, cold_format="
                              f"{formats[1]!r}: use kv_format='float' and no cold_format.")
    if model is not None or prefix_store is not None:
        raise CacheUsageError("per_head_eviction does no prefix caching (model=, prefix_store=): a prefix's heads "
                              "hold different tokens once evicted, so a page's content is not its tokens' hash. "
                              "Pass config=model.config instead of model=.")
    if per_layer_eviction is False:
        raise CacheUsageError("per_head_eviction chooses tokens per layer and per head: per_layer_eviction=False "
                              "(one table for all layers) contradicts it.")
    if isinstance(head_floor, bool) or not isinstance(head_floor, (int, float)) or not 0 <= head_floor <= 1:
        raise CacheUsageError(f"head_floor must be a number in [0, 1] (the share of an even split of the budget "
                              f"each head keeps at least), got {head_floor!r}.")


class HeadPool:
    """One layer's head pages, shared by forks: their ids from a `BlockManager` (unbounded: each row's budget is its
    layer's to keep) and their bytes in one `LayerPages` of the page store (float, one head, one token a page).

    Invariants: a page's reference count is the number of table rows (of this cache and its forks) that hold it, and
    it is free iff that count is 0; the pages hold at least the manager's ``num_pages`` pages. A head page is full
    once written (one token), so sharing it never copies it.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.manager = BlockManager(page_size=1)
        self.pages = make_layer_pages("float", 1, 1, keys.shape[-1], values.shape[-1], keys.dtype, keys.device)

    def take(self, n: int, limit: int | None) -> np.ndarray:
        """``n`` free pages, each now held once. When too few are free the pool grows by a quarter (amortised), but
        past ``limit`` pages (a bounded layer's budget, all rows) only as far as needed."""
        short, capacity = n - len(self.manager.free), self.manager.num_pages
        if short > 0:
            grown = capacity + max(short, capacity // 4)
            self.manager.grow_to(grown if limit is None else max(capacity + short, min(grown, limit)))
        ids = np.fromiter((self.manager.allocate() for _ in range(n)), dtype=np.int64, count=n)
        self.pages.grow_to(self.manager.num_pages)
        return ids

    def write(self, ids: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Pages ``ids`` take ``keys``/``values`` ``[len(ids), D]``."""
        slots = torch.from_numpy(ids).to(self.pages.device)
        self.pages.write(slots, keys.reshape(len(ids), 1, -1), values.reshape(len(ids), 1, -1))

    def share(self, ids: np.ndarray) -> None:
        for page in ids.tolist():
            self.manager.share(page)

    def release(self, ids: np.ndarray) -> None:
        """One holder fewer for each of ``ids`` (repeats count); pages nobody holds become free."""
        for page in ids.tolist():
            self.manager.release(page)


class HeadLayer(CacheLayerMixin):
    """One decoder layer of a `HeadPagedCache`: a table of head pages per (row, KV head) over its `HeadPool`.

    ``table[r, c]``: table row r's head page at column c (`HOLE` when none), ``pos`` its token's position, ``score``
    its usage (a moving average of its share relative to an even share of its head; 1.0 before any observation) and
    ``observed`` the steps that fed it; columns ``< width`` are in use, ``held[r]`` counts the pages of row r.
    ``undo``: (tokens before, first column) of the open step this layer wrote, None when it has no open step.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "HeadPagedCache", layer_idx: int, pool: HeadPool | None = None):
        self.owner, self.layer_idx, self.pool = owner, layer_idx, pool
        self.is_initialized = pool is not None
        self.heads, self.width = 0, 0
        owner.tables.cover(layer_idx + 1)
        self.tokens, self.undo, self.cut_pending, self.evictions = 0, None, False, 0
        self.backend: str | None = None
        self._kernel_index = None

    # (this layer's slices of the cache's stacked `HeadTables`)
    table = property(lambda self: self.owner.tables.table[self.layer_idx])
    pos = property(lambda self: self.owner.tables.pos[self.layer_idx])
    score = property(lambda self: self.owner.tables.score[self.layer_idx])
    observed = property(lambda self: self.owner.tables.observed[self.layer_idx])
    held = property(lambda self: self.owner.tables.held[self.layer_idx])

    @property
    def rows(self) -> int:
        return self.owner.tables.rows

    # ------------------------------------------------------------------ write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Make room (the row's lowest-scored head pages across its heads), write the step's tokens into fresh head
        pages; return `HeadRead` handles for the "hf_paged" attention."""
        self._ready_for(key_states, value_states)
        B, H, q, _ = key_states.shape
        before, budget = self.tokens, self.owner.max_pages
        self.cut_pending = False
        column = self.owner.tables.column
        if column is not None:
            return self._write_planned(column, key_states, value_states)
        if budget is not None:
            excess = self.held.reshape(B, H).sum(1) + q * H - budget * H
            if (excess > 0).any():
                if self.owner.policy.compress_prompt and q > 1:
                    self.cut_pending = True  # written whole, then cut by this step's usage (`observe`)
                else:
                    self._evict(excess, before + q, q)
        if too_wide(self.width, self.held.max()):
            self.compact()
        R = self.rows
        ids = self.pool.take(R * q, None if budget is None else R * budget)
        self.pool.write(ids, key_states.reshape(R * q, -1), value_states.reshape(R * q, -1))
        w0 = self.width
        self.owner.tables.room(w0 + q)
        columns = slice(w0, w0 + q)
        self.table[:, columns] = ids.reshape(R, q)
        self.pos[:, columns] = np.arange(before, before + q)
        self.score[:, columns], self.observed[:, columns] = 1.0, 0
        return self._wrote(before, w0, q)

    def _write_planned(self, column, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write a one-token step planned for every layer (`HeadTables.plan_step`: victims evicted, the column's
        positions and scores set) into this layer's column."""
        R, w0 = self.rows, column.index[self.layer_idx]
        ids = column.recycled.pop(self.layer_idx, None)
        if ids is None:
            ids = self.pool.take(R, R * self.owner.max_pages)
        self.pool.write(ids, key_states.reshape(R, -1), value_states.reshape(R, -1))
        self.table[:, w0] = ids
        return self._wrote(self.tokens, w0, 1)

    def _wrote(self, before: int, w0: int, q: int):
        """The step's ``q`` tokens stand in columns ``w0 ..``: count them, open the step; -> the attention's reads."""
        self.held[:] += q
        self.width = w0 + q
        self.undo, self.tokens = (before, w0), before + q
        read = HeadRead(self, q)
        return read, read

    def _ready_for(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            raise CacheUsageError(f"layer {self.layer_idx}: keys and values must be [batch, kv_heads, tokens, "
                                  f"head_dim], got {tuple(keys.shape)} and {tuple(values.shape)}.")
        B, H = keys.shape[:2]
        if self.pool is None:
            self.pool = HeadPool(keys, values)
            self.is_initialized = True
        pages = self.pool.pages
        got = (keys.shape[-1], values.shape[-1], keys.dtype, keys.device)
        want = (*pages.shape[1:3], pages.dtype, pages.device)
        if got != want or (self.heads and H != self.heads):
            raise CacheUsageError(f"layer {self.layer_idx}: new keys/values (head dims, dtype, device {got}, {H} kv "
                                  f"heads) do not match this layer's head pages ({want}, {self.heads} kv heads). "
                                  "Use a new cache for another model or dtype.")
        if not self.heads:
            self.heads = H
        tables = self.owner.tables
        if tables.rows == 0 and self.tokens == 0:
            tables.reset(B * H, 64, H)
        elif H != tables.heads:
            raise CacheUsageError(f"layer {self.layer_idx} has {H} kv heads, the cache's other layers "
                                  f"{tables.heads}: per_head_eviction needs as many kv heads in every layer.")
        elif B * H != self.rows:
            raise CacheUsageError(f"layer {self.layer_idx}: this cache holds {self.rows // H} rows, the new keys have "
                                  f"{B}: reset() it for a new batch (or reorder_cache / batch_select_indices).")
        if self.backend is None:
            self.backend = resolve_backend(self.owner.backend, keys.device)
            if self.backend == "cpu" and keys.dtype not in cpu_kernel.SUPPORTED_DTYPES:
                self.backend = "torch"

    def compact(self) -> None:
        """Each table row's pages to its front (in their order), the width down to the fullest row (between steps,
        when the width is `too_wide`)."""
        W = self.width
        order = np.argsort(self.table[:, :W] == HOLE, axis=1, kind="stable")
        for array in (self.table, self.pos, self.score, self.observed):
            array[:, :W] = np.take_along_axis(array[:, :W], order, axis=1)
        self.width = int(self.held.max())

    # -------------------------------------------------------------- eviction
    def ranks(self, tokens_after: int) -> np.ndarray:
        """``[R, width]``: each head page's rank for eviction (`head_ranks`)."""
        W = self.width
        return head_ranks(self.owner.policy, self.table[:, :W], self.pos[:, :W], self.score[:, :W],
                          self.observed[:, :W], tokens_after)

    def _evict(self, excess: np.ndarray, tokens_after: int, q_len: int = 0) -> None:
        """Row b gives up ``excess[b]`` head pages (its lowest ranks across its heads), each head keeping its floor
        once the step's ``q_len`` tokens are written; raises `PagePoolExhausted`, changing nothing, when a row
        cannot."""
        H, W = self.heads, self.width
        warn_head_eviction(self.owner.max_pages)
        floor = math.floor(self.owner.head_floor * self.owner.max_pages)
        rank = self.ranks(tokens_after).reshape(len(excess), H, W)
        cap = np.maximum(self.held + q_len - floor, 0).reshape(-1, H)
        picked = []
        for b in np.flatnonzero(excess > 0):
            rows, columns = choose_victims(rank[b], cap[b], int(excess[b]))
            if rows is None:
                raise PagePoolExhausted(int(excess[b]), int(np.isfinite(rank[b]).sum()), self.owner.max_pages, 1,
                                        lossy=True)
            picked.append((b * H + rows, columns))
        for rows, columns in picked:
            self.drop(rows, columns)

    def drop(self, rows: np.ndarray, columns: np.ndarray) -> None:
        """Evict the head pages at (``rows``, ``columns``) (distinct entries, none a hole)."""
        self.pool.release(self.table[rows, columns])
        self.table[rows, columns] = HOLE
        np.subtract.at(self.held, rows, 1)
        self.evictions += len(rows)

    def evicted(self, pages: np.ndarray) -> np.ndarray | None:
        """The step planned for every layer evicted this layer's head ``pages``: -> them, to take the step's tokens,
        when they are one a table row and nobody else holds them; else None, each released."""
        self.evictions += len(pages)
        if len(pages) == self.rows and all(self.pool.manager.ref[page] == 1 for page in pages.tolist()):
            return pages
        self.pool.release(pages)
        return None

    def kernel_index(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page table, positions) of every column of this layer's tables, as CPU tensors over the stacked arrays (made
        and checked once while the arrays stand: the CPU kernel keeps its checked arguments on them), and this layer's
        usage buffer of the same shape (`HeadTables.usage`)."""
        tables = self.owner.tables
        kept = self._kernel_index
        if kept is None or kept[0] is not tables.table or kept[1] is not tables.pos:
            table, pos = (torch.from_numpy(array[self.layer_idx]) for array in (tables.table, tables.pos))
            table, pos, _ = remember_kernel_index({}, table.device, self.pool.manager.num_pages,
                                                  (table, pos, torch.zeros(1, 1, dtype=torch.int64)))
            kept = self._kernel_index = (tables.table, tables.pos, table, pos, tables.usage_buffer()[self.layer_idx])
        return kept[2:]

    # ----------------------------------------------------------------- usage
    def observe(self, mass: torch.Tensor) -> None:
        """Fold the step's usage per head page ``[R, width]`` into the scores (`fold_usage`), then cut a compressed
        step to the budget."""
        W = self.width
        fold_usage(self.owner.policy.decay, self.table[:, :W], self.held, self.score[:, :W], self.observed[:, :W],
                   mass.detach().float().cpu().numpy())
        self._cut_pending_step()

    def observed_in_buffer(self) -> None:
        """The kernel wrote the step's usage into this layer's usage buffer: folded with every layer's at the next
        commit (`HeadTables.fold_pending`), or now when the step is to be cut to the budget."""
        tables = self.owner.tables
        tables.pending.append((self.layer_idx, self.width))
        if self.cut_pending:
            tables.fold_pending(self.owner.policy.decay)
            self._cut_pending_step()

    def _cut_pending_step(self) -> None:
        if self.cut_pending:
            self.cut_pending = False
            H = self.heads
            excess = self.held.reshape(-1, H).sum(1) - self.owner.max_pages * H
            if (excess > 0).any():
                self._evict(excess, self.tokens)

    # ------------------------------------------------------------ step undo
    def commit(self) -> None:
        self.undo = None

    def rollback(self) -> None:
        """Drop the open step's tokens (the evictions made for them stand)."""
        if self.undo is None:
            return
        before, w0 = self.undo
        appended = self.table[:, w0:self.width]
        live = appended != HOLE
        self.pool.release(appended[live])
        self.held[:] -= live.sum(axis=1)
        appended[:] = HOLE
        self.width, self.tokens, self.undo, self.cut_pending = w0, before, None, False

    # ------------------------------------------------------------ row moves
    def select_rows(self, index: np.ndarray) -> None:
        """Table row r is to become old row ``index[r]`` (repeats share head pages): count the pages the new rows
        hold, release the old rows' (the cache's `HeadTables.select_rows` then moves the rows of every layer)."""
        live = self.table[:, :self.width]
        new = live[index]
        self.pool.share(new[new != HOLE])
        self.pool.release(live[live != HOLE])

    def twin(self, owner: "HeadPagedCache") -> "HeadLayer":
        """This layer in a fork (whose tables are already a copy of this cache's): the same pool, each page held once
        more."""
        twin = HeadLayer(owner, self.layer_idx, self.pool)
        twin.heads, twin.tokens, twin.width, twin.backend = self.heads, self.tokens, self.width, self.backend
        if self.pool is not None:
            live = twin.table[:, :twin.width]
            self.pool.share(live[live != HOLE])
        return twin

    def crop_to(self, length: int) -> None:
        """Keep the tokens at positions ``< length``."""
        W = self.width
        rows, columns = np.nonzero((self.table[:, :W] != HOLE) & (self.pos[:, :W] >= length))
        if rows.size:
            self.pool.release(self.table[rows, columns])
            self.table[rows, columns] = HOLE
            np.subtract.at(self.held, rows, 1)
        self.tokens = min(self.tokens, length)

    def clear(self) -> None:
        """Hold nothing (the cache's `reset` then empties the tables of every layer)."""
        if self.pool is not None and self.rows:
            live = self.table[:, :self.width]
            self.pool.release(live[live != HOLE])
            live[:] = HOLE
            self.held[:] = 0
        self.width, self.tokens, self.undo, self.cut_pending = 0, 0, None, False

    # ---------------------------------------------------------- transformers
    def lazy_initialization(self, key_states, value_states) -> None:
        self._ready_for(key_states, value_states)

    def get_seq_length(self) -> int:
        return self.tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """Every position from 0: a head's kept tokens lie anywhere before the step."""
        return self.tokens + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.clear()


def head_ranks(policy: EvictionPolicy, table: np.ndarray, pos: np.ndarray, score: np.ndarray, observed: np.ndarray,
               tokens_after: int) -> np.ndarray:
    """Each head page's rank for eviction (its bias-corrected score; arrays of any shape ``[..., W]``), inf where a
    hole, a sink or one of the newest ``recent_pages`` tokens after the step."""
    if policy.decay:
        score = np.where(observed > 0, score / (1 - policy.decay ** np.maximum(observed, 1)), 1.0)
    kept = (table == HOLE) | (pos < policy.sink_pages) | (pos >= tokens_after - policy.recent_pages)
    return np.where(kept, np.inf, score)


def fold_usage(decay: float | None, table: np.ndarray, held: np.ndarray, score: np.ndarray, observed: np.ndarray,
               mass: np.ndarray) -> None:
    """Fold a step's usage ``mass`` per head page (any leading dims ``[..., R, W]``, 0 on holes) into ``score`` and
    ``observed`` (views, updated in place where ``table`` holds a page): each page's share relative to an even share
    of its table row's ``held`` pages, as it is (no decay) or in a moving average."""
    live = table != HOLE
    even = mass.sum(axis=-1, keepdims=True, dtype=np.float64) / np.maximum(held, 1)[..., None]
    share = np.divide(mass, even, out=np.zeros(mass.shape), where=even > 0)
    np.copyto(score, share if not decay else decay * score + (1 - decay) * share, where=live)
    observed += live


def too_wide(width, fullest):
    """Whether tables of ``width`` columns whose fullest row holds ``fullest`` pages are to be compacted: the fullest
    row a fifth, and 16 columns, narrower (numbers or arrays)."""
    return width - fullest > np.maximum(16, fullest // 4)


def warn_head_eviction(max_pages: int) -> None:
    logger.warning_once(f"PagedCache(max_pages={max_pages}, per_head_eviction=True) is full: evicting tokens per KV "
                        "head (lossy: evicted tokens are no longer attended).")


def choose_victims(rank: np.ndarray, cap: np.ndarray, count: int):
    """Of one row's head pages ``rank [H, W]`` (inf: never), the ``count`` lowest, at most ``cap[h]`` from head h
    (what it holds above its floor): -> (heads, columns), or (None, None) when fewer than ``count`` may go."""
    H, W = rank.shape
    if count < rank.size:  # the lowest ``count`` overall, when no head gives more than its cap
        chosen = np.argpartition(rank.reshape(-1), count - 1)[:count]
        heads = chosen // W
        if np.isfinite(rank.reshape(-1)[chosen]).all() and (np.bincount(heads, minlength=H) <= cap).all():
            return heads, chosen % W
    order = np.argsort(rank, axis=1, kind="stable")
    ranked = np.take_along_axis(rank, order, axis=1)
    ranked[np.arange(W)[None, :] >= cap[:, None]] = np.inf
    flat = ranked.reshape(-1)
    if count > np.isfinite(flat).sum():
        return None, None
    chosen = np.argpartition(flat, count - 1)[:count] if count < flat.size else np.arange(flat.size)
    heads = chosen // W
    return heads, order[heads, chosen % W]


class HeadRead(LayerRead):
    """What the "hf_paged" attention reads of a `HeadLayer` in one step (returned by its update in place of keys and
    values): `attend` runs the paged kernels over the per-head tables, rows = (batch row, KV head)."""

    def __init__(self, layer: HeadLayer, q_len: int):
        self.layer, self.q_len = layer, q_len

    def attend(self, query: torch.Tensor, attention_mask, scaling: float, sliding_window, softcap, s_aux):
        """``[B, Q, Hq, D]``: the queries over their heads' kept tokens; the layer observes the usage it needs."""
        if s_aux is not None:
            raise CacheUsageError("per_head_eviction reads one KV head a kernel row, whose sink logits (s_aux) would "
                                  "differ by row: models with attention sinks need per_head_eviction=False.")
        layer, (B, Hq, Q, D) = self.layer, query.shape
        H, W, R = layer.heads, layer.width, layer.rows
        G, policy = Hq // H, layer.owner.policy
        rows_query = query.reshape(R, G, Q, D)
        q_pos = torch.arange(layer.tokens - Q, layer.tokens).expand(R, Q)
        observing = layer.owner.max_pages is not None or layer.cut_pending
        whole = observing and Q <= policy.observation_window
        plain = attention_mask is None and (whole or not observing) and query.dtype == torch.float32
        if layer.backend == "cpu" and plain and Q <= CPU_KERNEL_MAX_QUERIES:  # (the kernel's checked arguments kept)
            table, pos, mass = layer.kernel_index()
            operands = layer.pool.pages.kernel_operands()
            out = cpu_kernel.plain_attention_cpu(rows_query, operands["k_pool"], operands["v_pool"], table, pos,
                                                 q_pos.contiguous(), scaling, sliding_window, softcap,
                                                 (policy.heads, policy.signal, mass) if whole else None)
            if whole:
                out = out[0]
                layer.observed_in_buffer()
            return _query_heads(out, B, H, Q, G)
        table, pos = torch.from_numpy(layer.table[:, :W]), torch.from_numpy(layer.pos[:, :W])
        mask, offset = _row_mask(attention_mask, B, H, G), 0
        if mask is not None:
            offset = layer.tokens - mask.shape[-1]
        device = layer.pool.pages.device
        if device.type != "cpu":
            table, pos, q_pos = table.to(device), pos.to(device), q_pos.to(device)
        pools = dict(**layer.pool.pages.kernel_operands(), page_table=table, page_pos=pos, q_pos=q_pos, scale=scaling,
                     mask=mask, mask_offset=offset, sliding_window=sliding_window, softcap=softcap)
        if layer.backend == "cpu" and Q <= CPU_KERNEL_MAX_QUERIES:
            result = cpu_kernel.paged_attention_cpu(
                rows_query, **pools, return_page_mass=whole, page_mass_heads=policy.heads if whole else None,
                page_mass_signal=policy.signal if whole else "attention")
        elif layer.backend == "triton" and not (whole and policy.signal == "output"):
            from .kernels.triton_paged_attention import paged_attention_triton

            result = paged_attention_triton(rows_query, **pools, return_page_mass=whole)
            if whole:
                result = result[0], policy.page_signal(result[1])
        else:
            result = gathered_attention(rows_query, layer, pools, policy, whole)
        out = result[0] if whole else result
        if whole:
            layer.observe(result[1])
        elif observing:
            w = policy.observation_window
            tail = dict(pools, q_pos=q_pos[:, -w:], mask=None if mask is None else mask[:, :, -w:])
            layer.observe(gathered_attention(rows_query[:, :, -w:], layer, tail, policy, True)[1])
        return _query_heads(out, B, H, Q, G)


def _query_heads(out: torch.Tensor, B: int, H: int, Q: int, G: int) -> torch.Tensor:
    """The kernel rows' ``[B·H, Q, G, D]`` output as the queries' ``[B, Q, H·G, D]``."""
    return out.reshape(B, H, Q, G, -1).permute(0, 2, 1, 3, 4).reshape(B, Q, H * G, -1)


def _row_mask(mask: torch.Tensor | None, B: int, H: int, G: int) -> torch.Tensor | None:
    """A boolean ``[B or 1, 1 or Hq, Q, M]`` mask as the kernel rows' ``[B·H or 1, 1 or G, Q, M]``."""
    if mask is None:
        return None
    if mask.dtype != torch.bool:
        mask = mask == 0
    if mask.shape[1] == 1:
        return mask if mask.shape[0] == 1 else mask.repeat_interleave(H, dim=0)
    rows = mask.expand(B, -1, -1, -1)
    return rows.reshape(B, H, G, *mask.shape[2:]).reshape(B * H, G, *mask.shape[2:])


def gathered_attention(query: torch.Tensor, layer: HeadLayer, pools: dict, policy: EvictionPolicy, usage: bool):
    """SDPA over each kernel row's gathered head pages (query ``[R, G, Q, D]``): ``out [R, Q, G, D]``, and with
    ``usage`` the usage per head page ``[R, W]`` (reduced over the G query heads by the policy)."""
    table, pos, q_pos = pools["page_table"], pools["page_pos"], pools["q_pos"]
    keys, values = layer.pool.pages.gather(table.clamp(min=0))  # [R, W, 1, 1, D]
    keys, values = keys.flatten(2), values.flatten(2)
    if not usage and pools["mask"] is None and not pools["sliding_window"] and _whole_in_order(table, pos, q_pos):
        return attend(query, keys[:, None], values[:, None], None, pools["scale"], is_causal=True,
                      softcap=pools["softcap"])  # (a prompt no head has evicted from: plain causal attention)
    allowed = (table >= 0)[:, None, :] & (pos[:, None, :] <= q_pos[:, :, None])  # [R, Q, W]
    if pools["sliding_window"]:
        allowed &= q_pos[:, :, None] - pos[:, None, :] < pools["sliding_window"]
    allowed = allowed[:, None]
    mask = pools["mask"]
    if mask is not None:
        column = pos - pools["mask_offset"]
        inside = (column >= 0) & (column < mask.shape[-1])
        index = column.clamp(0, mask.shape[-1] - 1)[:, None, None, :]
        rows = mask.expand(table.shape[0], -1, -1, -1)
        picked = rows.gather(-1, index.expand(-1, rows.shape[1], rows.shape[2], -1))
        allowed = allowed & picked & inside[:, None, None, :]
    result = attend(query, keys[:, None], values[:, None], allowed, pools["scale"], softcap=pools["softcap"],
                    return_probs=usage)
    if not usage:
        return result
    out, probs = result
    return out, policy.page_signal(page_usage(probs, out, values[:, :, None], 1, policy.signal))


def _whole_in_order(table: torch.Tensor, pos: torch.Tensor, q_pos: torch.Tensor) -> bool:
    """Every row holds every position ``0..W-1`` in order, and the queries are all of them (a fresh prompt)."""
    W = table.shape[1]
    return (W == q_pos.shape[1] and int(q_pos[0, 0]) == 0 and bool((table >= 0).all())
            and bool((pos == torch.arange(W, device=pos.device)).all()))

