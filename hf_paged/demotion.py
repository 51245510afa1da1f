"""Mixed precision: pages in two tiers, hot (float) and cold (re-quantized), read in place by the kernels.

Without a budget, ``PagedCache(cold_format="int4")`` keeps in float only what quantization hurts most: each row's
first ``sink_pages`` (the attention sinks) and the page being filled (the newest tokens); every other page turns cold
once full, when the step that filled it commits (`ColdPages.demote_filled`: at the start of the next step, or at a
`stats()`, `fork()` or row edit). In pages of 16 that
holds about int4 pages' bytes (0.154x of float32's, plus two float pages per row and layer).

Under a budget, a bounded cache re-quantizes its coldest pages before it evicts any.

``PagedCache(max_pages=M, cold_format="int4")`` holds, per layer group, at most the bytes of ``M`` float pages.
A page is written in the model's dtype (hot). When a step needs pages that the bytes cannot hold, the group
*demotes* its full pages with the lowest usage (the eviction policy's own ranking: its score, last use or age) to
``cold_format``, where a page costs a fraction of its float bytes (int4: 0.154x of a float32 page, int8: 0.258x,
int2: 0.092x in pages of one token),
and only when no hot page is left to demote does the policy evict, from what is then all cold. So the same bytes
hold about 6.5x (int4) or 3.9x (int8) the tokens before anything is dropped.

The pieces:

* `ColdPages`: a group's tier state, one per `TieredBlockManager` (shared by its forks): the live page ids held
  cold, the layers' pages, and `make_room` (a budget) or `demote_filled` (none), which demote.
* `TieredBlockManager`: a `BlockManager` whose bound counts bytes: ``max_pages`` reads ``M`` plus the ids that
  the cold pages' saved bytes pay for, so every check of the block manager and of eviction (``available``,
  ``require``, the eviction loop) holds the byte budget without knowing of it. A freed id is hot again.
* `MixedPages`: one layer's pages of both tiers (the `LayerPages` interface of `hf_paged.page_store`): float
  storage for hot pages, quantized storage (`hf_paged.kv_formats.QuantizedPages`) for cold ones,
  and per page id the row it occupies in either; the paged kernels read both tiers in place (`kernel_operands`:
  the hot pools, and the cold ones with the row maps as a `hf_paged.kernels.arguments.ColdTier`), the torch path
  through `gather`.

Invariants: every layer of a group has the same pages cold (all take the same writes, copies and demotions);
a page is in at most one tier of a layer; hot pages are written, cold pages only read (a write into a cold page
starts it afresh, or, into its middle after a crop, decodes it back to hot first); the bytes of a group's used
and cached pages, hot and cold, never exceed ``M`` float pages' (outside a compressed prompt's own step, as for
any bounded cache). Demotion, like eviction, is final: a rolled-back step keeps its demotions.

Cold pages are only ever written whole, when demoted: int4 in pages of 16 tokens or more is the "int4" page format
(keys per channel within the page, KIVI's; values one rotated group a token and head), in smaller pages (a page of
one token works) keys per token in rotated groups of 16 (`kv_formats.KEY_GROUP`), at the same bytes in pages of 16;
int2 likewise, four codes a byte (the "int2" page format; per token in groups of 16 in smaller pages); int8
symmetric per token and head (`cold_page_format`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .block_manager import EVICTED, BlockManager
from .errors import CacheUsageError
from .kernels.arguments import ColdTier
from .kv_formats import KEY_GROUP, PackedCodec, PageFormat, QuantizedPages, check_kv_format, page_format
from .model_config import head_dim
from .page_store import FloatPages

COLD_FORMATS = ("int4", "int2", "int8")


def cold_page_format(cold_format: str, page_size: int) -> PageFormat:
    """The page format of ``cold_format`` (`COLD_FORMATS`) in pages of ``page_size``: int4 (int2) keys per channel
    within a page (the "int4" ("int2") page format, KIVI's keys) in pages of `KEY_GROUP` tokens or more, where its
    per-page parameters cost no more than per-token groups of `KEY_GROUP`; per token in rotated groups of
    `KEY_GROUP` of the same bits in smaller pages. int8: per token and head."""
    fmt = page_format(cold_format)
    if getattr(fmt.key, "per_page", False) and page_size < KEY_GROUP:
        bits = fmt.key.bits
        return PageFormat(cold_format, PackedCodec(KEY_GROUP, bits=bits), PackedCodec(None, bits=bits), fmt.devices,
                          packing=fmt.packing)
    return fmt


def check_cold_format(cold_format, kv_format: str, config=None, prefix_store=None) -> None:
    """Raise `CacheUsageError` unless ``cold_format`` (None: no demotion) can serve a cache of these arguments (the
    model's ``config`` gives the head dim, when known), with a budget or without."""
    if cold_format is None:
        return
    if cold_format not in COLD_FORMATS:
        raise CacheUsageError(f"cold_format={cold_format!r} is not a cold page format; choose one of "
                              f"{', '.join(map(repr, COLD_FORMATS))}, or None (no demotion)")
    if kv_format != "float":
        raise CacheUsageError(f"cold_format={cold_format!r} demotes float pages: it needs kv_format='float', got "
                              f"{kv_format!r} (use one or the other)")
    if prefix_store is not None:
        raise CacheUsageError("cold_format and prefix_store cannot be combined: a prefix store keeps pages of one "
                              "format. Use one or the other.")
    check_kv_format(cold_format, head_dim=None if config is None else head_dim(config), argument="cold_format")


class ColdPages:
    """A layer group's tiers: ``ids`` (the live page ids held cold, the same in every layer), ``layers`` (the
    group's `MixedPages` by layer index) and ``demotions`` (pages demoted so far)."""

    def __init__(self, cold_format: str, page_size: int):
        self.cold_format, self.format = cold_format, cold_page_format(cold_format, page_size)
        self.ids: set[int] = set()
        self.layers: dict[int, MixedPages] = {}
        self.demotions = 0

    def make_layer(self, layer_idx: int, page_size: int, heads: int, head_dim: int, value_dim: int,
                   dtype: torch.dtype, device) -> "MixedPages":
        check_kv_format(self.cold_format, device, head_dim, value_dim, argument="cold_format")
        pages = MixedPages(self, page_size, heads, head_dim, value_dim, dtype, device)
        self.layers[layer_idx] = pages
        return pages

    def page_bytes(self) -> tuple[int, int]:
        """(hot, cold) bytes of one page over the group's layers."""
        return (sum(p.hot_page_bytes for p in self.layers.values()),
                sum(p.cold_page_bytes for p in self.layers.values()))

    def extra_pages(self) -> int:
        """Ids the cold pages' saved bytes pay for: a bound of M float pages holds ``M + extra_pages()`` ids."""
        count = len(self.ids)
        if not count:
            return 0
        hot, cold = self.page_bytes()
        return count - (count * cold + hot - 1) // hot

    def held_bytes(self, held: int) -> int:
        """Bytes of ``held`` used + cached pages of every layer, of which ``ids`` are cold."""
        hot, cold = self.page_bytes()
        return (held - len(self.ids)) * hot + len(self.ids) * cold

    def hot_full_pages(self, manager, rows: list[list[int]], first_page: int, num_tokens: int | list[int],
                       sink_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """The rows' held hot full pages past the first ``sink_pages``, each once (a page shared by rows: at its first
        place), and their ages (index in their row), oldest first. ``num_tokens``: the rows' tokens (one count for
        every row, or one per row: `hf_paged.ragged_cache`'s sequences)."""
        S = manager.page_size
        start = max(sink_pages - first_page, 0)
        counts = num_tokens if isinstance(num_tokens, list) else [num_tokens] * len(rows)
        spans = [np.asarray(row[start:n // S - first_page], dtype=np.int64)  # (entries before n // S are full pages)
                 for row, n in zip(rows, counts)]
        pages = np.concatenate([np.zeros(0, dtype=np.int64), *spans])
        age = np.concatenate([np.zeros(0, dtype=np.int64), *(start + np.arange(len(span)) for span in spans)])
        cold_row = next(iter(self.layers.values())).cold_row  # (every layer's: the group's cold ids, `ids`)
        held = pages != EVICTED
        held[held] = cold_row[pages[held]] < 0
        pages, age = pages[held], age[held]
        _, first = np.unique(pages, return_index=True)  # a page shared by rows: its first place (the oldest)
        first.sort()
        return pages[first], age[first]

    def make_room(self, manager, rows: list[list[int]], first_page: int, num_tokens: int, needed: int,
                  sink_pages: int, rank) -> int:
        """Demote the rows' hot full pages, lowest ``rank(pages, ages)`` first (the eviction policy's order; ties:
        the oldest), until ``manager`` has ``needed`` pages available or none is left (the first ``sink_pages`` stay
        hot, as they stay held). -> the number demoted."""
        if needed <= manager.available() or not self.layers:
            return 0
        pages, age = self.hot_full_pages(manager, rows, first_page, num_tokens, sink_pages)
        if not len(pages):
            return 0
        order = np.lexsort((age, rank(pages, age)))
        hot, cold = self.page_bytes()
        demoted = 0
        while demoted < len(order) and manager.available() < needed:
            count = math.ceil((needed - manager.available()) * hot / (hot - cold))
            self.demote(pages[order[demoted:demoted + count]], manager)
            demoted += count
        return min(demoted, len(order))

    def demote_filled(self, manager, rows: list[list[int]], first_page: int, num_tokens: int | list[int],
                      sink_pages: int) -> None:
        """No budget: every full page past the first ``sink_pages`` turns cold (once the step that filled it
        commits), so only the sinks and the page being filled are read in float."""
        if self.layers:
            pages, _ = self.hot_full_pages(manager, rows, first_page, num_tokens, sink_pages)
            if len(pages):
                self.demote(pages, manager)

    def demote(self, pages: np.ndarray, manager) -> None:
        """Re-quantize ``pages`` (hot, full) in every layer; they lose their content hashes (not a full forward's)."""
        for layer in self.layers.values():
            layer.demote(pages)
        for page in pages.tolist():
            manager.forget(page)
            self.ids.add(page)
        self.demotions += len(pages)

    def check_invariants(self, manager) -> None:
        """Assert the module's invariants for ``manager``'s live ids (tests)."""
        live = {p for p in range(manager.num_pages) if manager.ref[p] > 0 or p in manager.cached}
        assert self.ids <= live, "a free page is counted cold"
        for layer in self.layers.values():
            layer.check_invariants(self.ids, live)
        if manager.max_pages is not None:
            hot, cold = self.page_bytes()
            assert not self.layers or self.held_bytes(manager.num_used + len(manager.cached)) <= manager.bound * hot


def tier_stats(groups) -> dict:
    """``pages_cold`` (held cold now) and ``demotions`` (so far) summed over a cache's groups (any with a block
    ``manager``); {} without tiers."""
    tiers = [g.manager.cold for g in groups if g.manager.cold is not None]
    return dict(pages_cold=sum(len(t.ids) for t in tiers), demotions=sum(t.demotions for t in tiers)) if tiers else {}


def make_manager(page_size: int, max_pages: int | None, cold_format: str | None) -> BlockManager:
    """A layer group's block manager: pages of one tier (``cold_format`` None), else a `TieredBlockManager`."""
    return BlockManager(page_size, max_pages) if cold_format is None else TieredBlockManager(page_size, max_pages,
                                                                                            cold_format)


def pages_format(kv_format: str, cold_format: str | None) -> str:
    """The name of a cache's page format: ``kv_format``, or with a cold tier both (``"float+int4"``), as a layer's
    pages name it (``kv_format``) and prefix hashes take it into their root."""
    return kv_format if cold_format is None else f"{kv_format}+{cold_format}"


class TieredBlockManager(BlockManager):
    """A `BlockManager` whose bound is a byte budget of ``max_pages`` float pages: it holds more ids as pages turn
    cold (`ColdPages.extra_pages`); an id that becomes free (or is handed out again) is hot."""

    def __init__(self, page_size: int, max_pages: int | None, cold_format: str):
        self.cold = ColdPages(cold_format, page_size)
        self._max_pages = None
        super().__init__(page_size, max_pages)

    @property
    def max_pages(self) -> int | None:
        return None if self._max_pages is None else self._max_pages + self.cold.extra_pages()

    @max_pages.setter
    def max_pages(self, value: int | None) -> None:
        self._max_pages = value

    def allocate(self, prefer: int | None = None) -> int:
        page = super().allocate(prefer)
        self.cold.ids.discard(page)
        return page

    def release(self, page: int) -> None:
        super().release(page)
        if page in self.free:
            self.cold.ids.discard(page)

    def forget(self, page: int) -> None:
        super().forget(page)
        if page in self.free:
            self.cold.ids.discard(page)

    def release_all(self) -> None:
        super().release_all()
        self.cold.ids.difference_update(self.free)

    def reset(self) -> None:
        super().reset()
        self.cold.ids.clear()


class MixedPages:
    """One layer's pages in two tiers (module docstring): ``hot`` float rows and ``cold`` quantized rows, and per
    page id its row in each (``hot_row``/``cold_row``, -1: none). Read through `gather` or, in place, by the paged
    kernels (`kernel_operands`)."""

    def __init__(self, tiers: ColdPages, page_size: int, heads: int, head_dim: int, value_dim: int,
                 dtype: torch.dtype, device):
        self.tiers, self.page_size, self.dtype, self.device = tiers, page_size, dtype, torch.device(device)
        self.kv_format = pages_format("float", tiers.cold_format)
        self.hot = FloatPages(page_size, heads, head_dim, value_dim, dtype, self.device)
        self.cold = QuantizedPages(tiers.format, page_size, heads, head_dim, value_dim, dtype, self.device)
        self.hot.grow_to(1), self.cold.grow_to(1)
        self.hot_page_bytes, self.cold_page_bytes = self.hot.page_bytes(), self.cold.page_bytes()
        self.hot_row = np.full(0, -1, dtype=np.int64)
        self.cold_row = np.full(0, -1, dtype=np.int64)
        self._free = {"hot": [0], "cold": [0]}  # rows of each storage not holding a page

    @property
    def num_pages(self) -> int:
        return len(self.hot_row)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.hot.shape

    def grow_to(self, num_pages: int) -> None:
        """Page ids up to ``num_pages`` (their storage rows are taken when written)."""
        if num_pages > len(self.hot_row):
            grow = np.full(num_pages - len(self.hot_row), -1, dtype=np.int64)
            self.hot_row, self.cold_row = np.concatenate([self.hot_row, grow]), np.concatenate([self.cold_row, grow])

    def _take(self, tier: str, count: int) -> np.ndarray:
        """``count`` free rows of ``tier``'s storage (grown by doubling when short)."""
        free, storage = self._free[tier], getattr(self, tier)
        if len(free) < count:
            have = storage.num_pages
            storage.grow_to(max(2 * have, have + count - len(free)))
            free.extend(range(storage.num_pages - 1, have - 1, -1))
        rows = free[len(free) - count:]
        del free[len(free) - count:]
        return np.array(rows, dtype=np.int64)

    def _drop(self, tier: str, pages: np.ndarray) -> None:
        """``pages`` no longer hold rows of ``tier``."""
        table = self.hot_row if tier == "hot" else self.cold_row
        rows = table[pages]
        held = rows >= 0
        self._free[tier].extend(rows[held].tolist())
        table[pages[held]] = -1

    def _slots(self, rows: np.ndarray) -> torch.Tensor:
        """Every slot of storage ``rows``, page-major."""
        S = self.page_size
        return torch.from_numpy((rows[:, None] * S + np.arange(S)).reshape(-1)).to(self.device)

    def _to_hot(self, pages: np.ndarray, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``pages`` become hot holding ``keys``/``values`` ``[n, S, H, D]`` (their other rows dropped)."""
        self._drop("hot", pages), self._drop("cold", pages)
        rows = self._take("hot", len(pages))
        self.hot.write(self._slots(rows), keys.flatten(0, 1), values.flatten(0, 1))
        self.hot_row[pages] = rows

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Token t goes to slot ``slots[t]`` (page * S + offset) of a hot page. A page written from its first slot
        starts afresh (hot); a cold page written further in (after a crop) is decoded back to hot first."""
        S = self.page_size
        flat = slots.cpu().numpy().astype(np.int64)
        pages, offsets = flat // S, flat % S
        rows = self.hot_row[pages]
        if (rows >= 0).all():  # (a decode step's: pages already hot, so none is cold)
            self.hot.write(torch.from_numpy(rows * S + offsets).to(self.device), keys, values)
            return
        written, inverse = np.unique(pages, return_inverse=True)
        first = np.full(len(written), S, dtype=np.int64)
        np.minimum.at(first, inverse, offsets)
        is_cold = self.cold_row[written] >= 0
        cold = written[is_cold]
        if len(cold):
            resumed = cold[first[is_cold] > 0]
            if len(resumed):
                self._to_hot(resumed, *self.cold.gather(torch.from_numpy(self.cold_row[resumed])))
            self._drop("cold", cold)
            self.tiers.ids.difference_update(cold.tolist())
        fresh = written[self.hot_row[written] < 0]
        if len(fresh):
            self.hot_row[fresh] = self._take("hot", len(fresh))
        self.hot.write(torch.from_numpy(self.hot_row[pages] * S + offsets).to(self.device), keys, values)

    def demote(self, pages: np.ndarray) -> None:
        """Re-quantize the hot pages ``pages`` (full) into cold rows; their hot rows are freed."""
        keys, values = self.hot.gather(torch.from_numpy(self.hot_row[pages]).to(self.device))
        rows = self._take("cold", len(pages))
        self.cold.write(self._slots(rows), keys.flatten(0, 1), values.flatten(0, 1))
        self._drop("hot", pages)
        self.cold_row[pages] = rows

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: ``dst`` pages get ``src``'s tokens, hot (a cold source is decoded: the copy is written
        next, and only hot pages are written)."""
        keys, values = self.gather(src)
        self._to_hot(dst.cpu().numpy().astype(np.int64), keys, values)

    def gather(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[..., S, H, D]`` and values of ``pages [...]`` in ``dtype`` (cold pages dequantized; ids holding
        nothing read zeros)."""
        flat = pages.reshape(-1).cpu().numpy().astype(np.int64)
        known = flat < len(self.hot_row)
        hot_rows = np.where(known, self.hot_row[np.where(known, flat, 0)], -1)
        cold_rows = np.where(known, self.cold_row[np.where(known, flat, 0)], -1)
        H, D, Dv, S = self.hot.shape
        keys = torch.zeros(len(flat), S, H, D, dtype=self.dtype, device=self.device)
        values = torch.zeros(len(flat), S, H, Dv, dtype=self.dtype, device=self.device)
        for rows, read in ((hot_rows, self.hot.gather), (cold_rows, self.cold.gather)):
            held = np.flatnonzero(rows >= 0)
            if len(held):
                k, v = read(torch.from_numpy(rows[held]).to(self.device))
                at = torch.from_numpy(held).to(self.device)
                keys[at], values[at] = k, v
        return keys.reshape(*pages.shape, S, H, D), values.reshape(*pages.shape, S, H, Dv)

    def kernel_operands(self) -> dict:
        """The paged kernels' arguments: the hot pools (float), and the cold pools with both row maps (`ColdTier`;
        the maps share the numpy tables' memory on the CPU)."""
        maps = {name: torch.from_numpy(table).to(self.device) for name, table in
                (("hot_row", self.hot_row), ("cold_row", self.cold_row))}
        cold = self.cold.kernel_operands()
        pools = (cold["k_pool"], cold["v_pool"], cold["k_scale"], cold["v_scale"])
        return {**self.hot.kernel_operands(), "cold": ColdTier(*pools, self.cold.format, **maps)}

    def page_bytes(self) -> int:
        return self.hot_page_bytes  # (a hot page: what the budget counts in)

    def held_bytes(self, held: int) -> int:
        """Bytes of ``held`` used + cached pages of this layer, ``tiers.ids`` of them cold."""
        cold = len(self.tiers.ids)
        return (held - cold) * self.hot_page_bytes + cold * self.cold_page_bytes

    def pool_bytes(self) -> int:
        """Bytes allocated for both tiers' storage."""
        return self.hot.num_pages * self.hot_page_bytes + self.cold.num_pages * self.cold_page_bytes

    def residual_bytes(self) -> int:
        return 0  # (per-token codecs: nothing is kept at full precision beside the hot pages)

    def forget_residuals(self, pages) -> None:
        """``pages`` are free: their rows are given back."""
        ids = np.fromiter(pages, dtype=np.int64, count=len(pages))
        ids = ids[ids < len(self.hot_row)]
        self._drop("hot", ids), self._drop("cold", ids)

    def check_invariants(self, cold_ids: set[int], live: set[int]) -> None:
        for name, table in (("hot", self.hot_row), ("cold", self.cold_row)):
            rows = table[table >= 0]
            assert len(np.unique(rows)) == len(rows), f"two pages share a {name} row"
            assert not set(rows.tolist()) & set(self._free[name]), f"a {name} row is both held and free"
        assert not ((self.hot_row >= 0) & (self.cold_row >= 0)).any(), "a page in both tiers"
        cold = {int(p) for p in np.flatnonzero(self.cold_row >= 0)} & live
        assert cold == cold_ids, "a layer's cold pages differ from its group's"
