"""A cache's prefix store as a tier under its pool: pages written through, loaded on a lookup miss, spilled.

`StoreTier` is a `PrefixListener` on the `PrefixIndex` of every page group of one cache (one index for a
`RaggedCache`, one per layer group of a `PagedCache`; `attach`). It hears:

- ``run_hashed``: full pages of one sequence got their hashes. Their bytes (every layer of the group, raw:
  quantized codes and scales as stored) are copied out of the pool (`PageStore.read_pages`) and handed to the
  store, which writes them off the critical path when it is a `BackgroundWriter` (caches that open a URI make
  one). A prompt's pages are written whole (write-through); pages that decode steps filled only when they
  complete an entry (``layout.pages_per_entry`` pages), the others when they are evicted (spill, write-back);
- ``lookup_missed``: a lookup found no page for ``hashes[start]``. The store is walked for the longest run of
  leading pages it holds; if that reaches past ``start`` and loading is estimated faster than prefilling those
  tokens (`PrefixStore.decide_load`, with this cache's measured prefill rate), the run's entries are read,
  verified and written into fresh pages (`PrefixIndex.load_run`), which the lookup then takes. A run the store
  could not extend is not asked again for `NEGATIVE_SECONDS` (a lookup retried page by page stays one walk);
- ``page_evicted`` (spill, ``spill=True``): a hashed page about to be reused is written first, with the pages of
  its entry before it, unless an entry written or loaded by this cache already holds it.

Keys: the chained page hashes, in a namespace (`store_namespace`) of the hash root (the model fingerprint, no
device index), a digest of every weight (`weights_digest`: the fingerprint samples four values a parameter), the
pool dtype, page size, the group's layer windows, device type, page format (``kv_format``), `LAYOUT_VERSION`,
the group's layer indices and the page tensors' shapes (the weights digest and the last two folded into the
fingerprint given to the store): another model, one weight changed, another dtype, page size, window or format
gets zero hits. A fresh pool whose layers hold no pages yet reads with the shapes its model's config implies
(`kv_dims`); they name the namespace, so a wrong guess finds nothing and creates nothing.

Nothing here raises for a store fault: the store turns those into misses and skipped writes, with one warning.
"""

from __future__ import annotations

import hashlib
import math
import os
import time
import weakref
from collections import OrderedDict

import torch

from ..prefix_index import PrefixListener
from .base import PrefixStore
from .layout import PageLayout
from .load_policy import LoadDecision, ReadBandwidth
from .stats import StoreStats
from .uri import open_store

LAYOUT_VERSION = 1  # how a pool page maps to entry tensors (names, layer order, raw format tensors)
NEGATIVE_SECONDS = 1.0  # a lookup the store could not extend is not repeated for this long
REMEMBERED = 1 << 16  # page hashes remembered as stored by this cache (oldest forgotten first)
CACHE_COUNTERS = ("store_hits", "store_misses", "store_pages_read", "store_pages_written", "store_bytes_read",
                  "store_bytes_written", "store_load_seconds", "store_recomputed")


def kv_dims(config) -> tuple[int, int, int]:
    """(kv heads, key head dim, value head dim) a decoder config implies (what its attention layers cache)."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return heads, head_dim, head_dim


_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (parameter versions, digest)


def weights_digest(model: torch.nn.Module) -> bytes:
    """A digest of every weight's bytes (per parameter, the sum of its 32-bit words modulo 2**32: any one changed
    weight changes it; about 0.1 s for 0.5 GB on one core), so that a model with one weight changed gets other
    store keys; `model_fingerprint`, the hash root, samples only four values of
    each. Recomputed when a parameter changed in place (its version counter; edits through ``.data`` are not
    seen), else remembered per model."""
    params = [p for p in model.parameters() if p.device.type != "meta"]
    versions = tuple((id(p), p._version) for p in params)
    known = _DIGESTS.get(model)
    if known is not None and known[0] == versions:
        return known[1]
    sums = []
    for p in params:
        flat = p.detach().reshape(-1)
        if flat.numel() * flat.element_size() % 4 == 0:
            sums.append(flat.view(torch.int32).sum(dtype=torch.int32).to(torch.int64))  # (wraps: exact mod 2**32)
        else:
            sums.append(flat.view(torch.uint8).sum(dtype=torch.int64))
    digest = hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes() if sums else b"").digest()
    _DIGESTS[model] = (versions, digest)
    return digest


class _Bound:
    """What computes the pages now: the hash root, a digest of the weights, the pool's dtype, device (None: layers
    on several devices) and the K/V shape the config implies."""

    def __init__(self, root: bytes, weights: bytes, model):
        self.root, self.weights, self.dtype = root, weights, model.dtype
        devices = set(getattr(model, "hf_device_map", {}).values())
        self.device = model.device if len(devices) <= 1 else None
        self.dims = kv_dims(model.config)


def make_tier(prefix_store, spill: bool = True) -> "StoreTier | None":
    """The tier of a cache's ``prefix_store=`` argument: a URI or path opens a store with background writes, owned
    by the cache (`open_store` errors pass through: `StoreUnavailable`, ValueError); a store object is used as it is,
    shared (its writes run on the caller's thread unless it is a `BackgroundWriter`)."""
    if prefix_store is None:
        return None
    if isinstance(prefix_store, (str, os.PathLike)):
        return StoreTier(open_store(prefix_store, background=True), spill, owned=True)
    if isinstance(prefix_store, PrefixStore):
        return StoreTier(prefix_store, spill)
    raise ValueError(f"prefix_store must be a URI (file:///dir, a folder path, redis://host:port/db) or a store from "
                     f"hf_paged.open_store, got {type(prefix_store).__name__}.")


class _Group:
    """One index a tier listens to: its layers and their windows, and the position and entry chain of each page it
    heard hashed (for spill; dropped when the page loses its hash)."""

    def __init__(self, layers: list[int], windows: list):
        self.layers, self.windows = list(layers), list(windows)
        self.positions: dict[bytes, tuple] = {}  # page hash -> (position, first page of `chain`, chain)


class StoreTier(PrefixListener):
    """One cache's link to a `PrefixStore` (see the module docstring). ``owned``: the cache opened the store (from
    a URI) and closes it with `close`.

    Invariants: counters (`CACHE_COUNTERS`) count this cache's traffic only; pages are loaded only into fresh
    pages and only after the store verified them; a page hash is in ``_stored`` only if an entry written (or
    queued) or read and verified by this cache holds it.
    """

    def __init__(self, store, spill: bool = True, owned: bool = False):
        self.store, self.spill, self.owned = store, bool(spill), owned
        self.counters = StoreStats()
        self.prefill_rate = ReadBandwidth()  # tokens per second of this cache's prefills (its "bytes")
        self.last_decision: LoadDecision | None = None
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # PrefixIndex -> _Group
        self._bound: _Bound | None = None
        self._layouts: dict = {}
        self._stored: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # (namespace, page hash)
        self._absent: dict[tuple[str, bytes], float] = {}  # (namespace, page hash) -> when the store lacked it
        self._forward: tuple[float, int] | None = None

    # ------------------------------------------------------------------ set-up
    def attach_layers(self, layers) -> None:
        """Listen to the prefix index of every layer group among a cache's ``layers`` (each with ``group.prefix``,
        ``layer_idx`` and ``sliding_window``), knowing which layers (and windows) each index's pages hold."""
        members: dict[int, list] = {}
        for layer in layers:
            members.setdefault(id(layer.group), []).append(layer)
        for group_layers in members.values():
            index = group_layers[0].group.prefix
            if index not in self._groups:
                index.add_listener(self)
                self._groups[index] = _Group([m.layer_idx for m in group_layers],
                                             [m.sliding_window for m in group_layers])

    def bind(self, root: bytes, model) -> None:
        """``model`` computes the pages from now on, their hashes chained from ``root``."""
        weights = weights_digest(model)
        if self._bound is None or (self._bound.root, self._bound.weights) != (root, weights):
            self._bound = _Bound(root, weights, model)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A forward computed ``tokens`` prompt tokens in ``seconds``: the rate loads are weighed against."""
        self.prefill_rate.record(tokens, seconds)

    def forward_begins(self, tokens: int, page_size: int) -> None:
        """A forward of ``tokens`` tokens starts (timed until `forward_done` when it holds a page or more)."""
        self._forward = (time.perf_counter(), tokens) if tokens >= page_size else None

    def forward_done(self) -> None:
        if self._forward is not None:
            started, tokens = self._forward
            self.record_prefill(tokens, time.perf_counter() - started)
            self._forward = None

    def counters_snapshot(self) -> dict:
        """What the cache's ``stats()`` adds (the tier is no `PrefixListener.stats` source: it listens to several
        indexes): `CACHE_COUNTERS`, the store's own ``store_rejected`` / ``store_errors`` (shared by its users) and the
        last load decision's reason."""
        store = self.store.stats()
        out = {name: value for name, value in self.counters.snapshot().items() if name in CACHE_COUNTERS}
        out.update(store_rejected=store.get("store_rejected", 0), store_errors=store.get("store_errors", 0),
                   store_decision=None if self.last_decision is None else self.last_decision.reason)
        return out

    def flush(self) -> None:
        """Wait for queued writes (a `BackgroundWriter` store)."""
        flush = getattr(self.store, "flush", None)
        if flush is not None:
            flush()

    def close(self) -> None:
        """Flush, and close the store if this cache opened it."""
        self.flush()
        if self.owned:
            self.store.close()

    # ------------------------------------------------------------------ layout
    def _layout(self, index, fresh: bool = False) -> PageLayout | None:
        """The layout of ``index``'s pages; with ``fresh``, layers without pages yet take the config's shapes
        (None when unknown: nothing bound, or layers on several devices)."""
        bound, group = self._bound, self._groups[index]
        layers = group.layers
        pool = index.store
        if bound is None or pool is None:
            return None
        missing = [i for i in layers if pool.layer(i) is None]
        if missing and (not fresh or bound.device is None):
            return None
        specs = pool.page_specs(layers, bound.dims, bound.dtype, bound.device)
        key = (id(index), bound.root, bound.weights, tuple(sorted(specs.items())))
        if key not in self._layouts:
            described = repr((layers, sorted(specs.items()))).encode()  # (groups of one window differ in layers)
            root = hashlib.sha256(bound.root + bound.weights + described).digest()
            self._layouts[key] = PageLayout.create(
                model_fingerprint=root, dtype=bound.dtype, page_size=pool.page_size, layer_windows=group.windows,
                device_type=(bound.device or pool.layer(layers[0]).device).type, page_format=pool.kv_format,
                layout_version=LAYOUT_VERSION, tensors=specs)
        return self._layouts[key]

    # ------------------------------------------------------------------ writes
    def run_hashed(self, index, pages: list[int], hashes: list[bytes], start: int, generated: bool = False) -> None:
        if index not in self._groups:
            return
        layout = self._layout(index)
        if layout is None:
            return
        end, n = len(pages), layout.pages_per_entry
        base = layout.entry_start(start)
        chain = tuple(hashes[base:end])  # (the caller's list changes later)
        positions = self._groups[index].positions
        for i in range(start, end):
            positions[hashes[i]] = (i, base, chain)
        if generated and end % n:
            return  # decoded pages that complete no entry: written when they are evicted (spill)
        first = base
        held = [i for i in range(first, end) if pages[i] < 0]
        if held:
            first = layout.entry_start(held[-1]) + n  # entries with a page the sequence no longer holds are skipped
        if first < end and (layout.namespace, hashes[end - 1]) not in self._stored:
            self._write(index, layout, pages[first:end], hashes[first:end], first)

    def page_evicted(self, index, page: int, content_hash: bytes) -> None:
        group = self._groups.get(index)
        known = None if group is None else group.positions.pop(content_hash, None)
        layout = None if known is None or not self.spill else self._layout(index)
        if layout is None or (layout.namespace, content_hash) in self._stored:
            return
        position, base, chain = known
        first = layout.entry_start(position)
        hashes = chain[first - base:position - base + 1]
        earlier = [index.lookup(h) for h in hashes[:-1]]
        if any(p is None for p in earlier):
            return  # the entry's earlier pages left the pool: this page cannot form an entry
        self._write(index, layout, [*earlier, page], list(hashes), first)

    def _write(self, index, layout: PageLayout, pages: list[int], hashes: list[bytes], first: int) -> None:
        tensors = index.store.read_pages(torch.tensor(pages), self._groups[index].layers)
        self.store.put(layout, hashes, tensors, first)
        self.counters.add(store_pages_written=len(pages),
                          store_bytes_written=sum(t.numel() * t.element_size() for t in tensors.values()))
        self._remember(layout, hashes)

    def _remember(self, layout: PageLayout, hashes) -> None:
        for h in hashes:
            self._stored[layout.namespace, h] = None
            self._stored.move_to_end((layout.namespace, h))
        while len(self._stored) > REMEMBERED:
            self._stored.popitem(last=False)

    # ------------------------------------------------------------------ reads
    def lookup_missed(self, index, hashes: list[bytes], start: int, end: int) -> None:
        if index not in self._groups:
            return
        layout = self._layout(index, fresh=True)
        now = time.monotonic()
        if layout is None or self._absent.get((layout.namespace, hashes[start]), -math.inf) > now - NEGATIVE_SECONDS:
            return
        loaded = self._load(index, layout, hashes, start, end)
        if start + loaded < end:
            if len(self._absent) > REMEMBERED:
                self._absent = {k: t for k, t in self._absent.items() if t > now - NEGATIVE_SECONDS}
            self._absent[layout.namespace, hashes[start + loaded]] = now

    def _load(self, index, layout: PageLayout, hashes: list[bytes], start: int, end: int) -> int:
        """Load pages ``start .. end - 1`` of the longest stored run of ``hashes`` (read through the entry that holds
        it, which may end past ``end``: an entry is keyed by its last page); -> pages loaded."""
        wanted = end - start
        stored = self.store.contains_prefix(layout, hashes)
        found = min(stored, end) - start
        if found <= 0:
            self.counters.add(store_misses=wanted)
            return 0
        tokens = found * index.store.page_size
        decision = self.store.decide_load(found * layout.page_bytes, tokens, self.prefill_rate.bytes_per_second)
        self.last_decision = decision
        if not decision.load:
            self.counters.add(store_recomputed=1, store_misses=wanted)
            return 0
        started = time.perf_counter()
        layers = self._groups[index].layers
        index.store.make_layers(layers, self._bound.dims, self._bound.dtype, self._bound.device)
        runs = self.store.get(layout, hashes[:stored], first=start)  # (none: the entries failed to verify)
        skip = max(0, start - runs[0].first) if runs else 0  # (the first entry may begin before ``start``)
        tensors = {spec.name: torch.cat([run.tensors[spec.name] for run in runs])[skip:skip + found]
                   for spec in layout.tensors} if runs else {}
        verified = [h for run in runs for h in run.hashes]
        run_hashes = verified[skip:skip + found]

        def write(rows: list[int], pages: list[int]) -> None:  # every page in one write
            at = torch.tensor(rows)
            index.store.write_pages(torch.tensor(pages), layers, {name: t[at] for name, t in tensors.items()},
                                    index.manager.num_pages)

        loaded = index.load_run(run_hashes, write) if runs else 0  # (one call: its pages do not evict each other)
        self._remember(layout, [*hashes[:start + loaded], *verified])  # (the entries read are stored: not rewritten)
        nbytes = loaded * layout.page_bytes
        self.counters.add(store_hits=loaded, store_misses=wanted - loaded, store_pages_read=loaded,
                          store_bytes_read=nbytes, store_load_seconds=time.perf_counter() - started)
        return loaded
