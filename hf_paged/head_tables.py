"""Every layer's per-head page tables of a `HeadPagedCache`, stacked, and a decode step planned for all layers at once.

A `HeadLayer`'s arrays are its slice of `HeadTables`: ``table``, ``pos``, ``score``, ``observed`` ``[L, R, C]`` (table
row ``b·H + h`` of each layer) and ``held`` ``[L, R]``. So the steady decode step (one token a row, a bounded cache,
every layer at the same length, none with an open step) is planned once, at its first layer's write, for all layers
(issue 34: one plan per step): one pass ranks every layer's head pages, chooses each (layer, row)'s victims across its
heads, drops them, compacts the layers that need it and readies each layer's step column (`StepColumn`); each layer
then only writes its keys and values there. The victims, the compaction and the columns are those each layer makes
alone (`HeadLayer.update`): the same ranks, the same choice (up to exact ties among the ranks, which the layers' widths
may break otherwise). The usage the CPU kernel measures for each layer lands in one buffer ``[L, R, C]`` and is folded
into every layer's scores in one pass when the step commits (`fold_pending`).

Invariants: every layer has ``rows`` table rows (``heads`` KV heads each); columns at or past a layer's width are holes.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import PagePoolExhausted
from .head_eviction import HOLE, choose_victims, fold_usage, head_ranks, too_wide, warn_head_eviction


class HeadTables:
    """The stacked arrays of a cache's ``layers`` layers (``rows`` table rows each), and the planned step's column."""

    ARRAYS = (("table", HOLE), ("pos", 0), ("score", 1.0), ("observed", 0), ("held", 0))  # (name, an empty entry)

    def __init__(self, layers: int = 0):
        self.layers, self.heads = layers, 0
        self.reset(0, 0)

    def reset(self, rows: int, capacity: int, heads: int = 0) -> None:
        """Empty tables of ``rows`` rows (``heads`` KV heads a batch row) and ``capacity`` columns for every layer."""
        L = self.layers
        self.table = np.full((L, rows, capacity), HOLE, dtype=np.int64)
        self.pos = np.zeros((L, rows, capacity), dtype=np.int64)
        self.score = np.ones((L, rows, capacity), dtype=np.float64)
        self.observed = np.zeros((L, rows, capacity), dtype=np.int64)
        self.held = np.zeros((L, rows), dtype=np.int64)
        self.heads, self.column = heads, None
        self.usage, self.pending = None, []

    @property
    def rows(self) -> int:
        return self.held.shape[1]

    def cover(self, layers: int) -> None:
        """Room for ``layers`` layers (new ones hold nothing)."""
        more = layers - self.layers
        if more > 0:
            self._grow(0, more)
            self.layers = layers

    def room(self, width: int) -> None:
        """Columns for ``width`` entries in every layer (the arrays double)."""
        capacity = self.table.shape[2]
        if width > capacity:
            self._grow(2, max(width, 2 * capacity) - capacity)

    def _grow(self, axis: int, more: int) -> None:
        """``more`` empty entries along ``axis`` (0: layers, 2: columns) of every array."""
        for name, fill in self.ARRAYS:
            array = getattr(self, name)
            if array.ndim > axis:
                shape = list(array.shape)
                shape[axis] = more
                setattr(self, name, np.concatenate([array, np.full(shape, fill, dtype=array.dtype)], axis=axis))

    def select_rows(self, index: np.ndarray) -> None:
        """Table row r of every layer becomes old row ``index[r]`` (the layers move their pages' counts)."""
        for name, _ in self.ARRAYS:
            setattr(self, name, getattr(self, name)[:, index])

    def usage_buffer(self) -> torch.Tensor:
        """A float32 ``[L, R, C]`` tensor the CPU kernel writes each layer's usage of a step into (read by
        `fold_pending`), of the arrays' shape."""
        if self.usage is None or tuple(self.usage.shape) != self.table.shape:
            self.usage = torch.zeros(self.table.shape)
        return self.usage

    def fold_pending(self, decay: float | None) -> None:
        """Fold the usage the layers left in the buffer (``pending``: (layer, its width)) into their scores
        (`fold_usage`), every layer at once when they are the first layers in order."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        mass = self.usage.numpy()
        layers, widths = zip(*pending)
        n = len(layers)
        spans = [(slice(0, n), max(widths))] if layers == tuple(range(n)) else [
            (slice(l, l + 1), w) for l, w in pending]
        for at, W in spans:
            fold_usage(decay, self.table[at, :, :W], self.held[at], self.score[at, :, :W], self.observed[at, :, :W],
                       mass[at, :, :W])

    def copy(self) -> "HeadTables":
        """A fork's tables (no planned step)."""
        twin = HeadTables(self.layers)
        twin.heads = self.heads
        for name, _ in self.ARRAYS:
            setattr(twin, name, getattr(self, name).copy())
        return twin

    # ------------------------------------------------------------ one plan per step
    def plan_step(self, layers: list, max_pages: int, head_floor: float, policy) -> None:
        """Plan the next one-token step of every layer: each (layer, row) over its budget gives up its lowest-ranked
        head pages across its heads (each head keeping its floor); raises `PagePoolExhausted`, changing nothing, when
        a row cannot. Then the layers that need it are compacted, and each layer's step column is readied."""
        H, L, tokens = self.heads, len(layers), layers[0].tokens
        excess = self.held[:L].reshape(L, -1, H).sum(2) + H - max_pages * H
        if (excess > 0).any():
            victims = self._victims(layers, excess, tokens + 1, math.floor(head_floor * max_pages), policy, max_pages)
            warn_head_eviction(max_pages)
            recycled = self._drop(layers, victims)
        else:
            recycled = {}
        widths = self._compact(layers)
        self.room(int(widths.max()) + 1)
        at = (np.arange(L)[:, None], np.arange(self.rows)[None, :], widths[:, None])
        self.pos[at], self.score[at], self.observed[at] = tokens, 1.0, 0
        self.column = StepColumn(widths.tolist(), recycled)

    def _victims(self, layers: list, excess: np.ndarray, tokens_after: int, floor: int, policy, max_pages: int):
        """``(layer, table row, column)`` index arrays of every layer's victims for the step, in layer order (over the
        widest layer's columns: the others' are holes there)."""
        L, H, B = len(layers), self.heads, excess.shape[1]
        W = max(layer.width for layer in layers)
        rank = head_ranks(policy, self.table[:L, :, :W], self.pos[:L, :, :W], self.score[:L, :, :W],
                          self.observed[:L, :, :W], tokens_after).reshape(L * B, H * W)
        cap = np.maximum(self.held[:L] + 1 - floor, 0).reshape(L * B, H)
        return choose_stacked_victims(rank, cap, excess.reshape(-1), H, W, max_pages, B)

    def _drop(self, layers: list, victims: tuple) -> dict:
        """Evict the victims; -> the pages each layer may reuse for the step (`HeadLayer.evicted`)."""
        layer_of, rows, columns = victims
        pages = self.table[layer_of, rows, columns]
        self.table[layer_of, rows, columns] = HOLE
        np.subtract.at(self.held, (layer_of, rows), 1)
        bounds = np.searchsorted(layer_of, np.arange(len(layers) + 1))
        recycled = {}
        for l, layer in enumerate(layers):
            if bounds[l + 1] > bounds[l]:
                reusable = layer.evicted(pages[bounds[l]:bounds[l + 1]])
                if reusable is not None:
                    recycled[l] = reusable
        return recycled

    def _compact(self, layers: list) -> np.ndarray:
        """`HeadLayer.compact` of the layers whose fullest table row is `too_wide` for their width; -> every layer's
        width."""
        widths = np.array([layer.width for layer in layers])
        fullest = self.held[:len(layers)].max(1) if self.rows else np.zeros(len(layers), dtype=np.int64)
        for l in np.flatnonzero(too_wide(widths, fullest)).tolist():
            layers[l].compact()
            widths[l] = layers[l].width
        return widths

    def drop_column(self, layers: list) -> None:
        """Forget the planned step; the pages recycled for layers that never wrote it go back to their pools."""
        if self.column is not None:
            for l, pages in self.column.recycled.items():
                layers[l].pool.release(pages)
            self.column = None


def choose_stacked_victims(rank: np.ndarray, cap: np.ndarray, needs: np.ndarray, H: int, W: int, max_pages: int,
                           B: int) -> tuple:
    """The victims of rows ``rank [L·B, H·W]`` (``B`` rows a layer) that must give up ``needs[i]`` head pages, at most
    ``cap [L·B, H]`` from a head, each row's being `choose_victims`' choice (up to exact ties): when every row needs as
    many, ``count``, all rows at once: each head's ``count`` lowest in order (ties to the first column), those past its
    cap barred, then each row's ``count`` lowest of its heads' candidates. Raises `PagePoolExhausted` when a row cannot
    give up as many. -> (layer, table row, column) index arrays, in row order (so in layer order)."""
    over = np.flatnonzero(needs > 0)
    count = int(needs[over[0]])
    if not ((needs[over] == count).all() and count <= W):
        picks = []
        for i in over.tolist():
            heads, columns = choose_victims(rank[i].reshape(H, W), cap[i], int(needs[i]))
            if heads is None:
                raise PagePoolExhausted(int(needs[i]), int(np.isfinite(rank[i]).sum()), max_pages, 1, lossy=True)
            picks.append((np.full(len(heads), i), heads, columns))
        rows, heads, columns = (np.concatenate(parts) for parts in zip(*picks))
        return rows // B, (rows % B) * H + heads, columns
    n = len(over)
    remaining = rank[over].reshape(n, H, W)  # (a copy: each head's lowest are taken out in turn, lowest first)
    lowest, values = np.empty((n, H, count), dtype=np.int64), np.empty((n, H, count))
    at_row, at_head = np.arange(n)[:, None], np.arange(H)[None, :]
    for j in range(count):
        lowest[:, :, j] = column = remaining.argmin(axis=2)
        values[:, :, j] = remaining[at_row, at_head, column]
        remaining[at_row, at_head, column] = np.inf
    values[np.arange(count) >= cap[over][:, :, None]] = np.inf  # (a head gives up at most its cap)
    flat = values.reshape(len(over), H * count)
    short = np.flatnonzero(np.isfinite(flat).sum(1) < count)
    if short.size:
        i = over[short[0]]
        raise PagePoolExhausted(count, int(np.isfinite(rank[i]).sum()), max_pages, 1, lossy=True)
    chosen = np.argpartition(flat, count - 1, axis=1)[:, :count]
    columns = np.take_along_axis(lowest.reshape(len(over), H * count), chosen, axis=1)
    rows = np.repeat(over, count)
    return rows // B, (rows % B) * H + (chosen // count).reshape(-1), columns.reshape(-1)


class StepColumn:
    """The planned one-token step: the column each layer writes it into (``index[l]``), and the head pages layer l
    evicted for it that it reuses for the step's tokens (``recycled[l]``, one a table row; taken when it writes)."""

    def __init__(self, index: list[int], recycled: dict):
        self.index = index
        self.recycled = recycled
