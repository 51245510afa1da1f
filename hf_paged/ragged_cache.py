"""`RaggedCache`: pages for sequences of different lengths that join and leave a running cache.

Continuous batching packs the new tokens of every running sequence into one row,
``input_ids [1, T]`` with each token's own position: decode tokens (one per sequence) first,
then prefill chunks. `RaggedCache.begin_step` plans such a step once with the sequence core
(`hf_paged.page_tables`: attention spans, copy-on-write of shared partial pages, `StepUndo`, the kernel
index): pages for the new tokens, each token's slot, each sequence's page table; every layer then writes
its keys/values into those slots through its group's `PageStore` and hands attention `PagedKV` handles
of the packed step (the same view as `PagedCache`'s). Sequences are independent: each has its own
length, positions and pages; pages are shared (reference counted) between sequences that share a
prefix, found and registered through the groups' `PrefixIndex`, and a released sequence's hashed
pages stay cached for reuse, as in `PagedCache`.

Layers that keep the same tokens form a `RaggedGroup` (as in `PagedCache`: the full-attention layers one,
the layers of each sliding window another), with its own block manager, store and prefix index. A sliding
window's group frees a sequence's leading pages as they leave the window (at the next step), so its pages in
use stay bounded however long the sequences grow. ``groups[0]`` keeps the most tokens (full attention, else the
widest window): the scheduler budgets its pages (``cache.manager``), and every other group holds at most the
pages it holds for the same tokens, so within the same ``max_pages`` the others never run out first.

Invariants between steps, in every group:
- ``sequences[s].tables[g]`` holds the pages of the logical pages ``[0, ceil(length / S))`` in order, one
  reference each, except leading entries that left the group's window (`EVICTED`);
- a page referenced by two sequences is full, or is copied before either writes into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import PagedKV, PagedView, packed_attention
from .backends import check_backend, layer_backend
from .block_manager import EVICTED, MAX_PAGE_SIZE
from .compiled_many import RaggedRead
from .demotion import check_cold_format, make_manager
from .errors import CacheUsageError, check_positive_int
from .eviction import default_sink_pages
from .kv_formats import check_kv_format
from .model_config import head_dim, layer_windows
from .page_store import PageStore
from .page_tables import StepUndo, attention_span, copy_on_write, kernel_index
from .prefix_index import PrefixIndex
from .prefix_store.tier import make_tier
from .stats import ragged_cache_stats
from .thread_owner import ThreadOwner


@dataclass
class SequencePages:
    """One sequence in the cache: its page table in each group (``tables[0]``: the widest group's) and length."""

    tables: list[list[int]] = field(default_factory=list)
    length: int = 0  # tokens whose keys/values are written

    @property
    def pages(self) -> list[int]:
        """The page table in ``groups[0]`` (the one the scheduler budgets)."""
        return self.tables[0]


@dataclass
class Segment:
    """The new tokens of one sequence in a step: packed tokens ``[start, start + length)``."""

    seq_id: int
    start: int
    length: int
    past: int  # the sequence's tokens before this step
    pages: torch.Tensor  # long [n]: the sequence's page table in the group after this step
    first_page: int = 0  # its first entry that holds a page (the ones before left the window)


@dataclass
class RaggedStep:
    """What every layer of one group needs for one packed step; planned once, on the CPU.

    ``segments[:num_single]`` have one token each (decoding sequences): attention reads them with one
    paged-kernel call; the others (prefill chunks) attend over their gathered pages.
    """

    segments: list[Segment]
    num_single: int
    slots: torch.Tensor  # long [T]: flat slot (page * S + offset) of each packed token
    copy_src: torch.Tensor | None  # long [C]: shared partial pages copied before writing
    copy_dst: torch.Tensor | None
    page_size: int
    shared_start: bool = False  # two sequences begin with the same page (a shared prefix: `hf_paged.shared_prefix`)
    _on_device: dict = field(default_factory=dict)
    packed = True  # (a class constant) the tokens of several sequences in one row: see `PagedKV`

    def kernel_index(self, device: torch.device, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table [R, N], page_pos [R, N], q_pos [R, 1]) of the single-token segments (-1 padded)."""
        return kernel_index(self._on_device, device, num_pages, self._kernel_rows)

    def _kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        singles = self.segments[:self.num_single]
        width = max(len(s.pages) - s.first_page for s in singles)
        table = torch.full((len(singles), width), -1, dtype=torch.long)
        for r, s in enumerate(singles):
            table[r, :len(s.pages) - s.first_page] = s.pages[s.first_page:]
        first = torch.tensor([[s.first_page] for s in singles])
        page_pos = (torch.arange(width) + first) * self.page_size
        return table, page_pos, torch.tensor([[s.past] for s in singles])


class RaggedGroup:
    """The layers of a `RaggedCache` that keep the same tokens (one sliding window, or none): their block manager,
    page store and prefix index, and the step planned in them (``step``, ``undo`` until it is final)."""

    def __init__(self, sliding_window: int | None, page_size: int, max_pages: int | None, kv_format: str = "float",
                 cold_format: str | None = None):
        self.sliding_window = sliding_window
        self.span = attention_span(sliding_window, page_size)
        self.manager = make_manager(page_size, max_pages, cold_format)  # (two tiers with a cold format)
        self.sink_pages = default_sink_pages(page_size)  # kept float with a cold format (as `PagedCache`'s)
        self.store = PageStore(page_size, kv_format, self.manager)
        self.prefix = PrefixIndex(self.manager, self.store)  # prompt and generated pages, by content hash
        self.step: RaggedStep | None = None
        self.undo: StepUndo | None = None

    def first_needed(self, num_tokens: int) -> int:
        """First logical page that a step after ``num_tokens`` tokens reads."""
        return self.span.first_needed_page(num_tokens, 0)

    def holds_window(self, hashes: list[bytes], pages: int) -> bool:
        """The pages this group needs after a prefix of ``pages`` full pages (``hashes``) are all cached here."""
        return all(self.manager.lookup(h) is not None for h in hashes[self.first_needed(pages * self.span.page_size)
                                                                         :pages])

    def step_pages(self, tables: list[list[int]], lengths: list[int],
                   counts: list[int]) -> list[tuple[int, int | None]]:
        """Per sequence of a step (its table, length and new tokens, in packed order): the pages `plan` allocates
        for it and the shared partial page it copies (None: no copy). Every writer of a shared partial page copies
        it but the last one, which finds the page no longer shared and writes in place."""
        S, refs, out = self.span.page_size, {}, []
        for table, length, n in zip(tables, lengths, counts):
            copied = None
            if length % S:
                last = table[-1]
                holders = refs.get(last, self.manager.ref[last])
                if holders > 1:
                    copied, refs[last] = last, holders - 1
            out.append((math.ceil((length + n) / S) - len(table) + (copied is not None), copied))
        return out

    def plan(self, ids: list[int], tables: list[list[int]], lengths: list[int], counts: list[int],
             num_single: int, state: tuple = ()) -> RaggedStep:
        """Edit ``tables`` for a step (pages that left the window out, shared partial pages copied, new pages in;
        the pool was checked) and plan it; ``undo`` restores the tables (and ``state``) if it fails."""
        S, manager = self.span.page_size, self.manager
        self.undo = StepUndo(tables, state=state)
        segments, slots, copies, start = [], [], [], 0
        for seq_id, table, length, n in zip(ids, tables, lengths, counts):
            first = self.first_needed(length)
            self.undo.replaced += [p for p in table[:first] if p != EVICTED]  # released when the step is final
            table[:first] = [EVICTED] * min(first, len(table))
            copied = copy_on_write(manager, table, length, self.undo, release_now=True)
            if copied is not None:
                copies.append(copied)
            while len(table) * S < length + n:
                table.append(manager.allocate())
            slots += [table[p // S] * S + p % S for p in range(length, length + n)]
            segments.append(Segment(seq_id, start, n, length, torch.tensor(table, dtype=torch.long), first))
            start += n
        src, dst = (torch.tensor(side) for side in zip(*copies)) if copies else (None, None)
        starts = [table[0] for table in tables if table[0] != EVICTED]
        self.step = RaggedStep(segments, num_single, torch.tensor(slots, dtype=torch.long), src, dst, S,
                               len(set(starts)) < len(starts))
        return self.step

    def finish(self, sequences: dict | None = None, g: int = 0, prefilling=()) -> None:
        """The step is final (every layer wrote it): pages it replaced are released; with a cold format, the full
        pages of ``sequences`` (id -> `SequencePages`, whose table here is ``tables[g]``) past their sinks are demoted
        (`hf_paged.demotion.ColdPages.demote_filled`), but none that a sequence still ``prefilling`` holds: a prompt
        is read in float, as a `PagedCache`'s prefill reads it, whatever its chunks."""
        if self.undo is not None:
            self.undo.commit(self.manager)
            if self.manager.cold is not None and sequences:
                reading = {page for i in prefilling for page in sequences[i].tables[g]}
                done = [seq for i, seq in sequences.items() if i not in prefilling]
                tables = [[EVICTED if page in reading else page for page in seq.tables[g]] for seq in done]
                self.manager.cold.demote_filled(self.manager, tables, 0, [seq.length for seq in done], self.sink_pages)
        self.step, self.undo = None, None

    def register_hot_pages(self, table: list[int], hashes: list[bytes], start: int, end: int, generated: bool) -> None:
        """`PrefixIndex.register_pages` for a sequence's ``table``, but cold pages get no hash: not what a full
        forward computes, they are never shared (so prompts share only float sink pages)."""
        cold = self.manager.cold
        if cold is not None:
            table = [EVICTED if page in cold.ids else page for page in table]
        self.prefix.register_pages(table, hashes, 0, start, end, generated=generated)

    def abort(self) -> None:
        """The step failed: the tables are as before it, pages it brought in are released."""
        if self.undo is not None:
            self.undo.rollback(self.manager, self.undo.tables)
        self.step, self.undo = None, None


class RaggedLayer(CacheLayerMixin):
    """One decoder layer of a `RaggedCache`: writes the slots its group planned into its pages (in the group's
    store) and returns `PagedKV` handles of the packed step."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "RaggedCache", group: RaggedGroup, layer_idx: int):
        self.cache, self.group, self.layer_idx = cache, group, layer_idx  # (CacheLayerMixin.__init__ unused)
        self.backend = cache.backend
        self.sliding_window = group.sliding_window
        self.is_sliding = group.sliding_window is not None
        self.pages = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.pages = self.group.store.create(self.layer_idx, key_states, value_states)
        self.dtype, self.device = self.pages.dtype, self.pages.device
        self.resolved_backend = layer_backend(self.backend, self.pages)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.compiler.is_compiling():  # (a compiled forward: its attention op writes and reads the step)
            return RaggedRead(self.layer_idx, key_states, value_states), None
        view = self._write(key_states, value_states)
        return PagedKV(view, "k", tuple(key_states.shape)), PagedKV(view, "v", tuple(value_states.shape))

    def write_and_attend(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                         sliding_window: int | None, softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
        """The eager step of a compiled forward's attention op (``hf_paged::ragged_attention``): write the step's
        ``keys``/``values`` into their slots, then attend ``query`` over the pages (no `PagedKV` handles: the op
        is the only reader); returns ``[1, T, Hq, Dv]``."""
        return packed_attention(query, self._write(keys, values), scale, sliding_window, softcap, s_aux)

    def _write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> PagedView:
        """Write the step's keys and values ``[1, Hkv, T, D]`` into the slots planned for them; the layer's view of
        the step."""
        step = self.group.step
        if step is None or key_states.shape[0] != 1 or key_states.shape[2] != step.slots.numel():
            raise CacheUsageError(
                f"layer {self.layer_idx}: a RaggedCache takes the packed tokens of the step it planned "
                f"([1, heads, {0 if step is None else step.slots.numel()}, dim]), got {tuple(key_states.shape)}; "
                "it is driven by hf_paged.generate_many.")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        self.group.store.write(self.pages, self.group.manager.num_pages, move(step.slots),
                               key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), move(step.copy_src),
                               move(step.copy_dst))
        exact = self.pages.kv_format == "float" and key_states.dtype == self.pages.dtype  # pages hold them bit for bit
        return PagedView(self.pages, step, self.resolved_backend, step_kv=(key_states, value_states) if exact else None)

    def get_seq_length(self) -> int:
        return 0  # a packed step has no common past: positions come with the tokens

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return query_length, 0  # the mask transformers builds is not read: attention masks per segment

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        pass  # sequences are released through the cache


class RaggedCache(Cache):
    """Page pools and page tables for independent sequences (see the module docstring).

    Args:
        config: the model config (one layer per decoder layer; sliding windows from it).
        page_size: tokens per page.
        max_pages: pages in each group's pool (None: they grow); admission control keeps within it.
        backend: as for `PagedCache` ("auto", "cpu", "triton", "torch"; default ``$HF_PAGED_BACKEND``).
        kv_format, cold_format: as for `PagedCache`: how pages store keys and values ("float", "int8", "int4",
            "fp8_e4m3"), and "int4"/"int8" pages demoted once full (`RaggedGroup.finish`; max_pages then counts bytes).
        prefix_store, store_spill: a prefix store under the pool, as for `PagedCache` (prompt pages written
            through, loaded on a lookup miss, evicted hashed pages spilled; ``stats()`` counts the traffic).
    """

    def __init__(self, config, page_size: int = 16, max_pages: int | None = None, backend: str | None = None,
                 kv_format: str = "float", prefix_store=None, store_spill: bool = True, cold_format: str | None = None):
        if not isinstance(config, PretrainedConfig):
            raise CacheUsageError(f"config must be a transformers model config (model.config), got "
                                  f"{type(config).__name__}.")
        check_positive_int("page_size", page_size, most=MAX_PAGE_SIZE)
        check_positive_int("max_pages", max_pages, allow_none=True)
        check_backend(backend)
        check_kv_format(kv_format, head_dim=head_dim(config))
        check_cold_format(cold_format, kv_format, config, prefix_store)
        if "chunked_attention" in (getattr(config.get_text_config(decoder=True), "layer_types", None) or ()):
            raise CacheUsageError("generate_many does not support chunked_attention layers (Llama 4): use "
                                  "model.generate with a PagedCache for this model.")
        self.page_size, self.backend, self.kv_format, self.cold_format = page_size, backend, kv_format, cold_format
        windows = layer_windows(config)
        widest_first = sorted(set(windows), key=lambda w: -math.inf if w is None else -w)
        self.groups = [RaggedGroup(w, page_size, max_pages, kv_format, cold_format) for w in widest_first]
        by_window = dict(zip(widest_first, self.groups))
        super().__init__(layers=[RaggedLayer(self, by_window[w], i) for i, w in enumerate(windows)])
        self.store_tier = make_tier(prefix_store, store_spill)  # pages shared beyond this process (or None)
        if self.store_tier is not None:
            self.store_tier.attach_layers(self.layers)
        self.sequences: dict[int, SequencePages] = {}
        self.prefix_hits = 0  # pages new sequences shared from the cache instead of computing them
        self.user = None  # the run (`generate_many`) whose sequences the cache holds, while ``user.live``
        self._owner = ThreadOwner("RaggedCache", (
            "Give each thread its own RaggedCache (generate_many makes one when cache= is not given), or let the "
            "first thread's generate_many finish (or call cache.reset() in that thread) before handing it over."))

    # the widest group's: what the scheduler budgets, hashes and looks up
    manager = property(lambda self: self.groups[0].manager)
    store = property(lambda self: self.groups[0].store)
    prefix = property(lambda self: self.groups[0].prefix)
    step = property(lambda self: self.groups[0].step)

    # ----------------------------------------------------------------- users
    def claim(self, user) -> None:
        """``user`` (a `generate_many` run: ``user.live`` while it may still step) takes the cache, in this thread.

        Raises `CacheUsageError` when another thread holds the cache, or another live run still holds its
        sequences (a loop that left a `stream_many` generator early keeps them until the generator is closed).
        Sequences left by a run that ended without giving them back (an interrupt in its clean-up) are dropped.
        """
        self._owner.claim()
        if self.user is not None and self.user is not user and self.user.live:
            raise CacheUsageError(
                "this RaggedCache still holds the sequences of an unfinished generate_many run: a loop that left a "
                "stream_many generator early (break) keeps its sequences until that generator is closed or garbage "
                "collected. Call .close() on the generator (or cache.reset()) first, or pass another cache.")
        if self.sequences or any(g.undo is not None or g.step is not None for g in self.groups):
            self._clear()
            self._owner.claim()
        self.user = user

    def unclaim(self, user) -> None:
        """``user`` ended: the sequences it left are released and any thread may use the cache (nothing
        happens when ``user`` no longer holds the cache: it was reset, or another run took it)."""
        if self.user is user:
            self._clear()

    def holds(self, user) -> bool:
        """``user`` still holds the cache (it was not reset or taken by another run since `claim`)."""
        return self.user is user

    def reset(self) -> None:
        """Drop every sequence and any planned step; hashed pages stay cached for prefix reuse. The cache is then
        empty and free for any thread, and a paused `stream_many` that used it stops with an error when resumed.
        Whatever state an interrupt left the bookkeeping in, the cache is usable afterwards."""
        if self._owner.ident is not None:
            self._owner.claim()
        self._clear()

    def _clear(self) -> None:
        self.user = None
        self.sequences.clear()
        for group in self.groups:
            group.step, group.undo = None, None
            group.manager.release_all()
        self._owner.release()

    # ------------------------------------------------------------ sequences
    def cached_prefix(self, hashes: list[bytes], limit: int) -> list[int]:
        """The cached pages (in ``groups[0]``) of the longest run of leading full pages ``hashes`` (at most
        ``limit``) that every group holds what it needs of (a sliding window's group: the pages in its window)."""
        run = self.prefix.cached_run(hashes, limit)
        count = len(run)
        for group in self.groups[1:]:  # one lookup through each index, where a prefix store may load missing pages
            group.prefix.cached_run(hashes, count, group.first_needed(count * self.page_size))
        while count and not all(group.holds_window(hashes, count) for group in self.groups[1:]):
            count -= 1
        return run[:count]

    def add_sequence(self, seq_id: int, shared_pages: list[int] = (), length: int = 0) -> None:
        """A new sequence starting with ``shared_pages`` (cached or live pages of ``groups[0]`` holding ``length``
        tokens, found by `cached_prefix` when there are other groups: they share the same contents by hash)."""
        self._owner.claim()
        if seq_id in self.sequences:
            raise CacheUsageError(f"sequence {seq_id} is already in the cache")
        hashes = [self.manager.page_hash.get(p) for p in shared_pages]
        tables = [list(shared_pages)]
        for group in self.groups[1:]:
            first = group.first_needed(length)
            tables.append([EVICTED] * first + [group.manager.lookup(h) for h in hashes[first:]])
            if None in tables[-1]:
                raise CacheUsageError("add_sequence: the shared pages must be cached in every layer group (find "
                                      "them with cached_prefix).")
        for group, table in zip(self.groups, tables):
            group.manager.share_row(table)
        self.sequences[seq_id] = SequencePages(tables, length)
        self.prefix_hits += len(shared_pages)

    def fork_sequence(self, source: int, seq_id: int) -> None:
        """``seq_id`` starts as a copy of ``source``, sharing all its pages (the last one copied on write)."""
        self._owner.claim()
        if seq_id in self.sequences:
            raise CacheUsageError(f"sequence {seq_id} is already in the cache")
        src = self.sequences[source]
        for group, table in zip(self.groups, src.tables):
            group.manager.share_row(table)
        self.sequences[seq_id] = SequencePages([list(table) for table in src.tables], src.length)

    def release_sequence(self, seq_id: int) -> None:
        """Drop a sequence; its pages are released (hashed ones stay cached for prefix reuse). A sequence that is
        not (or no longer) in the cache is left alone: releasing is idempotent."""
        self._owner.claim()
        seq = self.sequences.pop(seq_id, None)  # first: an interrupted release leaks references (`reset` recounts
        if seq is not None:                      # them), it never releases a page twice
            for group, table in zip(self.groups, seq.tables):
                group.manager.release_row(table)

    def hash_pages(self, seq_id: int, hashes: list[bytes], start: int, end: int, generated: bool = False) -> None:
        """The sequence's full logical pages ``[start, end)`` get their content hashes ``hashes[i]`` in every group
        (pages that left a window are skipped); ``generated``: decode steps filled them (for a prefix store)."""
        for group, table in zip(self.groups, self.sequences[seq_id].tables):
            group.register_hot_pages(table, hashes, start, end, generated)

    def step_pages(self, new_tokens: list[tuple[int, int]]) -> list[tuple[int, int | None]]:
        """Per ``(seq_id, n)`` of a step, in packed order: the pages `begin_step` allocates for it in ``groups[0]``
        and the shared partial page it copies there (None: no copy); see `RaggedGroup.step_pages`."""
        return self._step_pages(0, new_tokens)

    def _step_pages(self, g: int, new_tokens: list[tuple[int, int]]) -> list[tuple[int, int | None]]:
        seqs = [self.sequences[seq_id] for seq_id, _ in new_tokens]
        return self.groups[g].step_pages([s.tables[g] for s in seqs], [s.length for s in seqs],
                                         [n for _, n in new_tokens])

    # ----------------------------------------------------------------- steps
    def begin_step(self, new_tokens: list[tuple[int, int]]) -> RaggedStep:
        """Plan a step that appends ``n`` tokens to each ``(seq_id, n)``, in that packed order, in every group;
        returns the plan of ``groups[0]``.

        Segments of one token must come first. Raises `PagePoolExhausted` when a pool cannot hold them, and
        `CacheUsageError` for a plan it cannot take, changing nothing.
        """
        self._owner.claim()
        num_single = next((i for i, (_, n) in enumerate(new_tokens) if n != 1), len(new_tokens))
        ids = [seq_id for seq_id, _ in new_tokens]
        if any(n == 1 for _, n in new_tokens[num_single:]) or any(n < 1 for _, n in new_tokens) \
                or len(set(ids)) != len(ids) or not all(seq_id in self.sequences for seq_id in ids):
            raise CacheUsageError(f"begin_step({new_tokens}): each (sequence in the cache, tokens >= 1) once, the "
                                  "one-token segments first.")
        self.finish_step()
        for g, group in enumerate(self.groups):
            group.manager.require(sum(pages for pages, _ in self._step_pages(g, new_tokens)))
        touched = [self.sequences[seq_id] for seq_id in ids]
        lengths, counts = [seq.length for seq in touched], [n for _, n in new_tokens]
        for g, group in enumerate(self.groups):
            group.plan(ids, [seq.tables[g] for seq in touched], lengths, counts, num_single,
                       state=tuple(zip(touched, lengths)) if g == 0 else ())
        for seq, n in zip(touched, counts):
            seq.length += n
        return self.step

    def finish_step(self, prefilling=()) -> None:
        """Make the planned step final (every layer wrote it): `RaggedGroup.finish` (``prefilling``: sequence ids)."""
        for g, group in enumerate(self.groups):
            group.finish(self.sequences, g, prefilling)

    def abort_step(self) -> None:
        """Undo the planned step: sequences get their pages and lengths back, new pages are released."""
        undo = self.groups[0].undo
        for seq, length in () if undo is None else undo.state:
            seq.length = length
        for group in self.groups:
            group.abort()

    def stats(self) -> dict:
        """Page and memory accounting with `PagedCache.stats`'s fields (`hf_paged.stats.ragged_cache_stats`), and with
        a prefix store its counters (``store_*``)."""
        return {**ragged_cache_stats(self), **({} if self.store_tier is None else self.store_tier.counters_snapshot())}

    def page_bytes(self) -> int:
        """Bytes of one page summed over every layer's keys and values (0 before the first step)."""
        return sum(group.store.page_bytes() for group in self.groups)

    @property
    def prefix_store(self):
        """The prefix store this cache reads and writes (None without one): ``flush()`` waits for its writes."""
        return None if self.store_tier is None else self.store_tier.store

    # ------------------------------------------------------------ transformers
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0
