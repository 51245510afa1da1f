"""`RaggedCache`: pages for sequences of different lengths that join and leave a running cache.

Continuous batching packs the new tokens of every running sequence into one row,
``input_ids [1, T]`` with each token's own position: decode tokens (one per sequence) first,
then prefill chunks. `RaggedCache.begin_step` plans such a step once with the sequence core
(`hf_paged.page_tables`: copy-on-write of shared partial pages, `StepUndo`, the kernel index): pages
for the new tokens, each token's slot, each sequence's page table; every layer then writes its
keys/values into those slots through the cache's `PageStore` and hands attention `PagedKV` handles
of the packed step (the same view as `PagedCache`'s). Sequences are independent: each has its own
length, positions and pages; pages are shared (reference counted) between sequences that share a
prefix, found and registered through the cache's `PrefixIndex`, and a released sequence's hashed
pages stay cached for reuse, as in `PagedCache`.

Invariants between steps:
- ``sequences[s].pages`` holds the pages of tokens ``[0, sequences[s].length)`` in order, one
  reference each (every layer keeps every token; sliding windows are applied by the mask);
- a page referenced by two sequences is full, or is copied before either writes into it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import PagedKV, PagedView
from .backends import check_backend, layer_backend
from .block_manager import MAX_PAGE_SIZE, BlockManager
from .errors import CacheUsageError, check_positive_int
from .model_config import layer_windows
from .page_store import PageStore
from .page_tables import StepUndo, copy_on_write, kernel_index
from .prefix_index import PrefixIndex
from .prefix_store.tier import make_tier
from .stats import ragged_cache_stats
from .thread_owner import ThreadOwner


@dataclass
class Sequence:
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose keys/values are written


@dataclass
class Segment:
    """The new tokens of one sequence in a step: packed tokens ``[start, start + length)``."""

    seq_id: int
    start: int
    length: int
    past: int  # the sequence's tokens before this step
    pages: torch.Tensor  # long [n]: the sequence's pages after this step


@dataclass
class RaggedStep:
    """What every layer needs for one packed step; planned once, on the CPU.

    ``segments[:num_single]`` have one token each (decode rows): attention reads them with one
    paged-kernel call; the others (prefill chunks) attend over their gathered pages.
    """

    segments: list[Segment]
    num_single: int
    slots: torch.Tensor  # long [T]: flat slot (page * S + offset) of each packed token
    copy_src: torch.Tensor | None  # long [C]: shared partial pages copied before writing
    copy_dst: torch.Tensor | None
    page_size: int
    _on_device: dict = field(default_factory=dict)
    packed = True  # (a class constant) the tokens of several sequences in one row: see `PagedKV`

    def kernel_index(self, device: torch.device, num_pages: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(page_table [R, N], page_pos [R, N], q_pos [R, 1]) of the single-token segments (-1 padded)."""
        return kernel_index(self._on_device, device, num_pages, self._kernel_rows)

    def _kernel_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        singles = self.segments[:self.num_single]
        width = max(len(s.pages) for s in singles)
        table = torch.full((len(singles), width), -1, dtype=torch.long)
        for r, s in enumerate(singles):
            table[r, :len(s.pages)] = s.pages
        page_pos = (torch.arange(width) * self.page_size).expand(len(singles), -1)
        return table, page_pos, torch.tensor([[s.past] for s in singles])


class RaggedLayer(CacheLayerMixin):
    """One decoder layer of a `RaggedCache`: writes the slots its cache planned into its pages (in the cache's
    store) and returns `PagedKV` handles of the packed step."""

    is_compileable = False
    is_croppable = False

    def __init__(self, cache: "RaggedCache", layer_idx: int, sliding_window: int | None):
        self.cache, self.layer_idx, self.backend = cache, layer_idx, cache.backend  # (CacheLayerMixin.__init__ unused)
        self.sliding_window, self.is_sliding = sliding_window, sliding_window is not None
        self.pages = None
        self.is_initialized = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.pages = self.cache.store.create(self.layer_idx, key_states, value_states)
        self.dtype, self.device = self.pages.dtype, self.pages.device
        self.resolved_backend = layer_backend(self.backend, self.device, self.dtype)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        step = self.cache.step
        if step is None or key_states.shape[0] != 1 or key_states.shape[2] != step.slots.numel():
            raise CacheUsageError(
                f"layer {self.layer_idx}: a RaggedCache takes the packed tokens of the step it planned "
                f"([1, heads, {0 if step is None else step.slots.numel()}, dim]), got {tuple(key_states.shape)}; "
                "it is driven by hf_paged.generate_many.")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        self.cache.store.write(self.pages, self.cache.manager.num_pages, move(step.slots),
                               key_states[0].transpose(0, 1), value_states[0].transpose(0, 1), move(step.copy_src),
                               move(step.copy_dst))
        view = PagedView(self.pages, step, self.resolved_backend)
        return PagedKV(view, "k", tuple(key_states.shape)), PagedKV(view, "v", tuple(value_states.shape))

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
        max_pages: pages in the pool (None: it grows); admission control keeps within it.
        backend: as for `PagedCache` ("auto", "cpu", "triton", "torch"; default ``$HF_PAGED_BACKEND``).
        prefix_store, store_spill: a prefix store under the pool, as for `PagedCache` (prompt pages written
            through, loaded on a lookup miss, evicted hashed pages spilled; ``stats()`` counts the traffic).
    """

    def __init__(self, config, page_size: int = 16, max_pages: int | None = None, backend: str | None = None,
                 prefix_store=None, store_spill: bool = True):
        if not isinstance(config, PretrainedConfig):
            raise CacheUsageError(f"config must be a transformers model config (model.config), got "
                                  f"{type(config).__name__}.")
        check_positive_int("page_size", page_size, most=MAX_PAGE_SIZE)
        check_positive_int("max_pages", max_pages, allow_none=True)
        check_backend(backend)
        layer_types = getattr(config.get_text_config(decoder=True), "layer_types", None) or ()
        if "chunked_attention" in layer_types:
            raise CacheUsageError("generate_many does not support chunked_attention layers (Llama 4): use "
                                  "model.generate with a PagedCache for this model.")
        self.page_size, self.backend = page_size, backend
        self.manager = BlockManager(page_size, max_pages)
        self.store = PageStore(page_size)
        self.prefix = PrefixIndex(self.manager, self.store)  # prompt and generated pages, by content hash
        super().__init__(layers=[RaggedLayer(self, i, w) for i, w in enumerate(layer_windows(config))])
        self.store_tier = make_tier(prefix_store, store_spill)  # pages shared beyond this process (or None)
        if self.store_tier is not None:
            self.store_tier.attach(self.prefix, [layer.layer_idx for layer in self.layers],
                                   [layer.sliding_window for layer in self.layers])
        self.sequences: dict[int, Sequence] = {}
        self.step: RaggedStep | None = None
        self._undo: StepUndo | None = None  # the sequences' tables and lengths before `step`
        self.prefix_hits = 0  # pages new sequences shared from the cache instead of computing them
        self.user = None  # the run (`generate_many`) whose sequences the cache holds, while ``user.live``
        self._owner = ThreadOwner("RaggedCache", (
            "Give each thread its own RaggedCache (generate_many makes one when cache= is not given), or let the "
            "first thread's generate_many finish (or call cache.reset() in that thread) before handing it over."))

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
                "this RaggedCache still holds the rows of an unfinished generate_many run: a loop that left a "
                "stream_many generator early (break) keeps its rows until that generator is closed or garbage "
                "collected. Call .close() on the generator (or cache.reset()) first, or pass another cache.")
        if self.sequences or self._undo or self.step is not None:
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
        self.step, self._undo, self.user = None, None, None
        self.sequences.clear()
        self.manager.release_all()
        self._owner.release()

    # ------------------------------------------------------------ sequences
    def add_sequence(self, seq_id: int, shared_pages: list[int] = (), length: int = 0) -> None:
        """A new sequence starting with ``shared_pages`` (cached or live pages holding ``length`` tokens)."""
        self._owner.claim()
        if seq_id in self.sequences:
            raise CacheUsageError(f"sequence {seq_id} is already in the cache")
        self.manager.share_row(list(shared_pages))
        self.sequences[seq_id] = Sequence(list(shared_pages), length)
        self.prefix_hits += len(shared_pages)

    def fork_sequence(self, source: int, seq_id: int) -> None:
        """``seq_id`` starts as a copy of ``source``, sharing all its pages (the last one copied on write)."""
        self._owner.claim()
        if seq_id in self.sequences:
            raise CacheUsageError(f"sequence {seq_id} is already in the cache")
        src = self.sequences[source]
        self.manager.share_row(src.pages)
        self.sequences[seq_id] = Sequence(list(src.pages), src.length)

    def release_sequence(self, seq_id: int) -> None:
        """Drop a sequence; its pages are released (hashed ones stay cached for prefix reuse). A sequence that is
        not (or no longer) in the cache is left alone: releasing is idempotent."""
        self._owner.claim()
        seq = self.sequences.pop(seq_id, None)  # first: an interrupted release leaks references (`reset` recounts
        if seq is not None:                      # them), it never releases a page twice
            self.manager.release_row(seq.pages)

    def step_pages(self, new_tokens: list[tuple[int, int]]) -> list[tuple[int, int | None]]:
        """Per ``(seq_id, n)`` of a step, in packed order: the pages `begin_step` allocates for it and the shared
        partial page it copies (None: no copy). Every writer of a shared partial page copies it but the last one,
        which finds the page no longer shared and writes in place."""
        S, refs, out = self.page_size, {}, []
        for seq_id, n in new_tokens:
            seq, copied = self.sequences[seq_id], None
            if seq.length % S:
                last = seq.pages[-1]
                holders = refs.get(last, self.manager.ref[last])
                if holders > 1:
                    copied, refs[last] = last, holders - 1
            out.append((math.ceil((seq.length + n) / S) - len(seq.pages) + (copied is not None), copied))
        return out

    # ----------------------------------------------------------------- steps
    def begin_step(self, new_tokens: list[tuple[int, int]]) -> RaggedStep:
        """Plan a step that appends ``n`` tokens to each ``(seq_id, n)``, in that packed order.

        Segments of one token must come first. Raises `PagePoolExhausted` when the pool cannot hold them, and
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
        S, manager = self.page_size, self.manager
        manager.require(sum(pages for pages, _ in self.step_pages(new_tokens)))
        segments, slots, copies, start = [], [], [], 0
        touched = [self.sequences[seq_id] for seq_id, _ in new_tokens]
        self._undo = StepUndo([seq.pages for seq in touched], state=tuple((seq, seq.length) for seq in touched))
        for seq, (seq_id, n) in zip(touched, new_tokens):
            copied = copy_on_write(manager, seq.pages, seq.length, self._undo, release_now=True)
            if copied is not None:
                copies.append(copied)
            while len(seq.pages) * S < seq.length + n:
                seq.pages.append(manager.allocate())
            positions = torch.arange(seq.length, seq.length + n)
            pages = torch.tensor(seq.pages, dtype=torch.long)
            slots.append(pages[positions // S] * S + positions % S)
            segments.append(Segment(seq_id, start, n, seq.length, pages))
            seq.length += n
            start += n
        src, dst = (torch.tensor(side) for side in zip(*copies)) if copies else (None, None)
        self.step = RaggedStep(segments, num_single, torch.cat(slots), src, dst, S)
        return self.step

    def finish_step(self) -> None:
        """Make the planned step final (every layer wrote it): pages it replaced are released."""
        if self._undo is not None:
            self._undo.commit(self.manager)
        self.step, self._undo = None, None

    def abort_step(self) -> None:
        """Undo the planned step: sequences get their pages and lengths back, new pages are released."""
        if self._undo is not None:
            self._undo.rollback(self.manager, self._undo.tables)
            for seq, length in self._undo.state:
                seq.length = length
        self.step, self._undo = None, None

    def stats(self) -> dict:
        """Page and memory accounting with `PagedCache.stats`'s fields (`hf_paged.stats.ragged_cache_stats`), and with
        a prefix store its counters (``store_*``)."""
        return {**ragged_cache_stats(self), **({} if self.store_tier is None else self.store_tier.counters_snapshot())}

    def page_bytes(self) -> int:
        """Bytes of one page summed over every layer's keys and values (0 before the first step)."""
        return self.store.page_bytes()

    @property
    def prefix_store(self):
        """The prefix store this cache reads and writes (None without one): ``flush()`` waits for its writes."""
        return None if self.store_tier is None else self.store_tier.store

    # ------------------------------------------------------------ transformers
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0
