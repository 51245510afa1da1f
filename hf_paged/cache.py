"""`PagedCache`: a transformers `Cache` whose layers (`PagedLayer`) keep K/V in pages.

The rows of one batch advance in lockstep, one step at a time, through the cache's layer groups (`LayerGroups`):
the first layer of a group to write a step plans it, every layer writes its keys and values into the planned
slots through its group's page store and returns `PagedKV` handles that the "hf_paged" attention reads.
"""

from __future__ import annotations

import copy
import numbers
import threading

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from .attention import CompiledRead, PagedKV, read_window, warn_gathered_pages
from .backends import check_backend, layer_backend
from .block_manager import MAX_PAGE_SIZE
from .compiled import CompiledSteps
from .demotion import check_cold_format
from .errors import CacheUsageError, check_positive_int
from .eviction import EvictionPolicy
from .layer_groups import LayerGroup, LayerGroups
from .kv_formats import check_kv_format
from .model_config import ATTN_IMPLEMENTATION, head_dim, layer_windows
from .page_store import FloatPages
from .prefix_reuse import PrefixHook, PrefixReuse
from .thread_owner import ThreadOwner


def _identical_rows(keys: torch.Tensor, values: torch.Tensor) -> list[int]:
    """``same_as[b]``: the first row of the run of consecutive rows identical to row b."""
    same_prev = ((keys[1:] == keys[:-1]).flatten(1).all(1) & (values[1:] == values[:-1]).flatten(1).all(1))
    same_as = [0]
    for b, same in enumerate(same_prev.tolist(), start=1):
        same_as.append(same_as[-1] if same else b)
    return same_as


class PagedLayer(CacheLayerMixin):
    """One decoder layer of a `PagedCache`: its pages (a `LayerPages` in its group's `PageStore`, shared with forks), a
    member of its `LayerGroup` (which plans the steps and counts the tokens each layer wrote); writes the slots its
    group planned and returns `PagedKV` handles."""

    is_compileable = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, group: LayerGroup, layer_idx: int, backend: str | None = None, pages: FloatPages | None = None):
        self.pages = pages  # in the group's store (CacheLayerMixin.__init__ is not called: it would reset them)
        self.is_initialized = False
        if pages is not None:
            self._adopt_pages()
        self.group = group
        self.backend = backend  # "cpu" | "torch" | "triton" | "auto" | None (= $HF_PAGED_BACKEND)
        self._resolved_backend: str | None = None  # what `backend` means for these pages, on first use
        self.compiled: CompiledRead | None = None  # what attention reads in a compiled forward's step
        self.compiled_sizes = (0, (0, 0))  # (get_seq_length, get_mask_sizes) before that step
        self.layer_idx = layer_idx
        self.is_sliding = group.sliding_window is not None
        self.sliding_window = group.sliding_window
        group.members.join(self)

    def fork(self, group: LayerGroup) -> "PagedLayer":
        """A layer of a forked cache: same pages (the store is shared), the fork's own page tables."""
        twin = PagedLayer(group, self.layer_idx, self.backend, self.pages)
        group.members.join(twin, self.get_seq_length())
        return twin

    def __repr__(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.is_sliding else ""
        return f"PagedLayer({self.layer_idx}{window})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The layer's pages in its group's store, made for these keys unless they exist."""
        self.pages = self.group.store.create(self.layer_idx, key_states, value_states)
        self._adopt_pages()

    def _adopt_pages(self) -> None:
        """Take dtype, device and shapes from the pages: every later update must match them."""
        self.dtype, self.device = self.pages.dtype, self.pages.device
        self._on_host = self.device.type == "cpu"  # (a plan is made on the host: no move per call)
        self.num_heads, self.head_dim, self.value_dim, _ = self.pages.shape
        self._signature = (self.num_heads, self.head_dim, self.value_dim, self.dtype, self.dtype, self.device,
                           self.device)
        self.is_initialized = True

    # ------------------------------------------------------------------ write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens into their slots; return `PagedKV` handles (no copy of the cache)."""
        self._ready_for(key_states, value_states)
        batch, _, q_len, _ = key_states.shape
        group = self.group
        plan = group.join_step(self, batch, q_len, lambda: _identical_rows(key_states, value_states))
        if plan.same_as is not None:
            self._check_identical_rows(key_states, value_states, plan.same_as)
            plan = group.step  # rebuilt if rows had to be unshared
        if not self._on_host:
            plan = plan.on(self.device)
        if q_len > 1:  # token-major [B, q, H, D], the order of plan.slots (with one token it already is)
            key_states, value_states = key_states.transpose(1, 2), value_states.transpose(1, 2)
        group.store.write(self.pages, group.manager.num_pages, plan.slots,
                          key_states.reshape(-1, self.num_heads, self.head_dim),
                          value_states.reshape(-1, self.num_heads, self.value_dim), plan.copy_src, plan.copy_dst)
        group.wrote(self)
        view = group.read_view(self.pages, plan, self._resolved_backend)
        shape = (batch, self.num_heads, plan.kv_len)
        return PagedKV(view, "k", (*shape, self.head_dim)), PagedKV(view, "v", (*shape, self.value_dim))

    def _ready_for(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The layer's pages exist (made for these keys on first use), the keys match them, the backend is known."""
        if not self.is_initialized:
            self._check_shapes(key_states, value_states)
            self.lazy_initialization(key_states, value_states)
        self._check(key_states, value_states)
        if self._resolved_backend is None:
            self._resolved_backend = layer_backend(self.backend, self.pages)

    def begin_compiled(self, batch: int, q_len: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """This layer's part of a compiled forward's step, done before the forward's layers run (`PagedCache`):
        `update`'s bookkeeping (pages, plan, growth, copy-on-write) and the `CompiledRead` the layer's update returns.
        ``keys``/``values`` give the pages' shapes, dtype and device when the layer has none yet; rows of a fresh
        batch do not share pages."""
        self._ready_for(keys, values)
        group = self.group
        self.compiled_sizes = (self.tokens_written, group.mask_sizes(q_len))  # as the forward asks before it runs
        group.join_step(self, batch, q_len, lambda: list(range(batch)))
        plan = group.step.on(self.device)
        group.store.prepare(self.pages, group.manager.num_pages, plan.copy_src, plan.copy_dst)
        group.wrote(self)
        self.compiled = CompiledRead(group.read_view(self.pages, plan, self._resolved_backend), plan.slots)

    def _check_identical_rows(self, key_states: torch.Tensor, value_states: torch.Tensor, same_as: list[int]) -> None:
        """Rows the group shares because the first layer saw identical keys must be identical here too."""
        source = torch.tensor(same_as, device=key_states.device)
        differ = ((key_states != key_states[source]).flatten(1).any(1)
                  | (value_states != value_states[source]).flatten(1).any(1)).nonzero().flatten().tolist()
        if differ:  # rare (identical tokens, different masks): give those rows their own pages
            self.group.unshare(differ)

    def copy_pages(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, copy) page pair of this layer's pages (the group unshared rows mid-step)."""
        self.pages.grow_to(self.group.manager.num_pages)
        self.pages.copy_pages(*(torch.tensor(side, device=self.device) for side in zip(*pairs)))

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
            raise CacheUsageError(
                f"layer {self.layer_idx}: keys and values must be [batch, kv_heads, tokens, head_dim] with "
                f"matching leading sizes, got {tuple(key_states.shape)} and {tuple(value_states.shape)}."
            )

    def _check(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        keys, values = key_states.shape, value_states.shape
        if len(keys) != 4 or len(values) != 4 or keys[:3] != values[:3]:
            self._check_shapes(key_states, value_states)
        got = (keys[1], keys[3], values[3], key_states.dtype, value_states.dtype, key_states.device,
               value_states.device)
        want = self._signature
        if got != want:
            names = ("kv heads", "key head dim", "value head dim", "key dtype", "value dtype", "key device",
                     "value device")
            diffs = ", ".join(f"{n} {g} (pool has {w})" for n, g, w in zip(names, got, want) if g != w)
            fix = ("This cache holds no tokens: call cache.bind_config(model.config) to serve the new model with it "
                   "(reset() keeps the pools of the model it served), or use a new cache."
                   if self.group.num_tokens == 0 and not self.group.rows else
                   "A PagedCache serves one model in one dtype and device placement: call cache.reset() and then "
                   "cache.bind_config(model.config), or use a new cache for another model, or cast the model "
                   "instead of the cache.")
            raise CacheUsageError(f"layer {self.layer_idx}: new keys/values do not match this layer's page pool: "
                                  f"{diffs}. {fix}")

    # ------------------------------------------------------------------- read
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tokens ``[first_pos, num_tokens)`` as ``[B, T, H, D]``: a view on a slab, else a gather."""
        return read_window(self.pages, self.group.step.on(self.device))

    # ------------------------------------------------------------ transformers
    def get_seq_length(self) -> int:
        """Tokens this layer has processed: mid-step, a layer that has not written yet still reports
        the tokens before the step, as a `DynamicCache` layer does (Llama 4 asks before writing)."""
        return self.tokens_written

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.group.mask_sizes(query_length)

    def get_max_length(self) -> int:
        return -1

    def activate_past_recording(self, **recurrent_options) -> None:
        """Assisted decoding: keep sliding-window pages until the next `crop` (it may roll back).

        ``recurrent_options`` (transformers >= 5.25 passes ``recurrent_states_to_keep``) concern
        linear-attention layers only; attention pages ignore them."""
        self.group.record_past = True

    def reset(self) -> None:
        """Forget this layer's tokens (it rejoins its group with none); its pages are kept for reuse."""
        self.group.members.join(self)

    def offload(self):
        raise NotImplementedError("PagedCache does not offload layers; bound it with max_pages instead.")

    prefetch = offload


def _refuse_rewind(held: int, new_tokens: int, args, kwargs) -> None:
    """A prompt whose positions start before the ``held`` tokens a cache already processed (every row's): a second
    `generate` on a used cache. transformers would write it after them at the wrong positions, silently (as with
    `DynamicCache`). Checked on the first layer of a step of several tokens, where the model passes position_ids."""
    extra = kwargs.get("kwargs") or kwargs.get("cache_kwargs") or (args[0] if args and isinstance(args[0], dict)
                                                                    else None) or {}
    positions = extra.get("position_ids")
    if held and new_tokens > 1 and isinstance(positions, torch.Tensor) and positions.shape[-1] == new_tokens:
        start = int(positions[..., 0].max())
        if start < held:
            raise CacheUsageError(
                f"this PagedCache already holds {held} tokens, and the new input starts at position {start}: one "
                "cache per call, or reset() it first (to continue a conversation, pass every token so far).")


def _check_arguments(config, model, lru_threshold, kv_format: str) -> None:
    """Types that would otherwise fail later with an AttributeError or TypeError; a page format that the model's
    head dim or devices cannot have (a cache without a model checks its device on its first write, before writing
    anything)."""
    if isinstance(lru_threshold, bool) or not isinstance(lru_threshold, (int, float)):
        raise CacheUsageError(f"lru_threshold must be a number: a positive multiple of an even attention share, "
                              f"got {lru_threshold!r}.")
    if config is not None and not isinstance(config, PretrainedConfig):
        raise CacheUsageError(
            f"config must be a transformers model config (model.config), got {type(config).__name__}.")
    if model is not None and not (isinstance(model, torch.nn.Module) and isinstance(getattr(model, "config", None),
                                                                                    PretrainedConfig)):
        raise CacheUsageError(f"model must be a transformers model (a torch.nn.Module with a .config), "
                              f"got {type(model).__name__}.")
    config = config if config is not None or model is None else model.config
    check_kv_format(kv_format, head_dim=None if config is None else head_dim(config))
    for device in () if model is None else {p.device for p in model.parameters() if p.device.type != "meta"}:
        check_kv_format(kv_format, device)


def check_cache_arguments(page_size, max_pages, config, model, backend, lru_threshold, kv_format: str) -> None:
    """What a `PagedCache` (of either variant) checks first: page size, bound, backend and `_check_arguments`."""
    check_positive_int("page_size", page_size, most=MAX_PAGE_SIZE)
    check_positive_int("max_pages", max_pages, allow_none=True)
    _check_arguments(config, model, lru_threshold, kv_format)
    check_backend(backend)


class CacheVariant:
    """Which cache ``PagedCache(...)`` makes: with ``per_head_eviction=True``, the one that evicts per KV head,
    registered as ``per_head_class`` by hf_paged/__init__ (`hf_paged.head_cache.HeadPagedCache`, a subclass of
    `PagedCache` that this module does not import). ``head_floor`` belongs to that variant only."""

    per_head_class: type | None = None

    def __new__(cls, *args, per_head_eviction: bool = False, head_floor: float | None = None, **kwargs):
        variant = cls.per_head_class if per_head_eviction else cls
        if head_floor is not None and variant is not cls.per_head_class:
            raise CacheUsageError("head_floor is the per-head floor of per_head_eviction=True; set both, or neither.")
        return super().__new__(variant)


def _row_indices(name: str, indices, groups: LayerGroups) -> list[int]:
    """``indices`` as rows of the cache, else a clear error (a negative index would silently wrap around)."""
    order = torch.as_tensor(indices).reshape(-1)
    if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
        raise CacheUsageError(f"{name} takes integer row indices, got a {order.dtype} tensor.")
    order = order.tolist()
    batch = max((group.batch_size for group in groups.values()), default=0)
    bad = [i for i in order if not 0 <= i < batch]
    if batch and bad:
        raise CacheUsageError(f"{name}: row indices {bad[:5]} are outside [0, {batch}): the cache holds {batch} "
                              "rows, numbered from 0 (no negative indices).")
    return order


def _crop_count(tokens_to_remove) -> int:
    """``crop``'s argument as an int, else a clear error."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral) or tokens_to_remove > 0:
        raise CacheUsageError(f"crop({tokens_to_remove!r}): pass a negative int, the number of tokens to remove, as "
                              "with DynamicCache.")
    return int(tokens_to_remove)


class PagedCache(CacheVariant, PrefixReuse, CompiledSteps, Cache):
    """A paged KV cache for ``model.generate`` (``past_key_values=`` or ``cache=``).

    Args:
        page_size: tokens per page, any positive int.
        max_pages: pages per layer group; None lets the pool grow (geometrically, +25% at a time).
        config: the model config; builds sliding-window layers up front (their pages are freed
            as they leave the window) and checks the attention implementation.
        backend: "cpu" (the C kernel), "triton" (CUDA, or CPU with TRITON_INTERPRET=1), "torch" (SDPA on page views)
            or "auto" (Triton on CUDA, the C kernel on the CPU); default ``$HF_PAGED_BACKEND`` or "auto".
        eviction: what a bounded pool does when full: "score", "lru", "fifo" or "error" (raise `PagePoolExhausted`);
            default "score"; see `hf_paged.eviction`. Or a whole `EvictionPolicy` in place of the keywords below.
        sink_pages / recent_pages: pages never evicted at the start / end of each row (default sinks: 4 tokens' pages).
        lru_threshold: "lru" counts a page as used when its attention share is this multiple of an even share.
        score_decay: "score" keeps this weight of a page's past score per step (0: the last step only).
        observation_window: the last queries of a step whose attention scores pages.
        score_heads / score_signal: the heads' "mean" or "max"; a page's "attention", or the "output" it would move
            if dropped (these four default by page size: `eviction.usage_signal_defaults`).
        compress_prompt: a prompt larger than ``max_pages`` is prefilled whole, then cut to the bound
            by the attention of its last ``observation_window`` tokens (else: raise, feed it in chunks).
        eviction_interval: k > 1 (pages of 1): a full cache's decode steps choose victims k at a time, one evicted a
            step (faster, no loss measured: docs/eviction.md); None: 8 for the "score" default's 1-token pages, else 1.
        per_layer_eviction: each layer keeps its own pages and evicts by its own attention (the default
            for a bounded "score" or "lru" cache); False: the layers of a group share one page table.
        model: bind the cache to this model (implies ``config=model.config``) for prefix caching: full pages get
            content hashes; a prompt whose leading pages are cached (after ``reset()``, in a fork) computes the rest.
        kv_format: how pages store K/V (`hf_paged.kv_formats`): "float" (model's dtype), "int8", "int4", "fp8_e4m3".
        cold_format: "int4", "int8": full pages but the sinks demoted; with max_pages (bytes) coldest first, on need.
        prefix_store / store_spill: with ``model=``, a prefix store under the pool (a URI, a folder or an
            `hf_paged.open_store` object; docs/prefix_store.md); whether hashed pages the pool evicts go to it first.
        per_head_eviction / head_floor: each (layer, row, KV head) keeps its own tokens (page_size 1, "score"), each
            head at least ``head_floor`` of an even split: a `hf_paged.head_cache.HeadPagedCache` (`CacheVariant`).

    ``get_seq_length()`` counts tokens processed, never tokens stored, so positions stay right.
    """

    def __init__(self, page_size: int = 16, max_pages: int | None = None, config=None, backend: str | None = None,
                 model=None, eviction: str | EvictionPolicy | None = None, sink_pages: int | None = None,
                 recent_pages: int = 1, lru_threshold: float = 1.0, score_decay: float | None = None,
                 observation_window: int | None = None, score_heads: str | None = None, compress_prompt: bool = False,
                 per_layer_eviction: bool | None = None, score_signal: str | None = None, kv_format: str = "float",
                 prefix_store=None, store_spill: bool = True, cold_format: str | None = None, eviction_interval=None,
                 per_head_eviction: bool = False, head_floor: float | None = None):  # (these two: `CacheVariant`)
        check_cache_arguments(page_size, max_pages, config, model, backend, lru_threshold, kv_format)
        check_cold_format(cold_format, kv_format, config or getattr(model, "config", None), prefix_store)
        self.backend, self.kv_format, self.cold_format = backend, kv_format, cold_format
        self.policy = EvictionPolicy.of(page_size, eviction, sink_pages, recent_pages, lru_threshold, score_decay,
                                        observation_window, score_heads, compress_prompt, score_signal,
                                        eviction_interval)
        super().__init__(layers=[])
        self.page_size = page_size
        self.max_pages = max_pages
        self.per_layer_eviction = (max_pages is not None and self.policy.tracks_usage if per_layer_eviction is None
                                   else bool(per_layer_eviction))
        self.groups = LayerGroups()
        self._owner = ThreadOwner()
        self.config = None
        self.bind_model(model, prefix_store, store_spill)  # prefix caching: token log, forward hook, prefix store
        config = config or (model.config if model is not None else None)
        if config is not None:
            self.bind_config(config)

    # ------------------------------------------------------------- structure
    def bind_config(self, config) -> None:
        """One layer per decoder layer, grouped by sliding window (an empty cache may serve another model)."""
        _check_arguments(config, None, self.policy.threshold, self.kv_format)
        if getattr(config, "is_encoder_decoder", False):
            raise CacheUsageError(
                f"PagedCache supports decoder-only models; {type(config).__name__} is an encoder-decoder model "
                "(its cross-attention keys would share the cache). Use transformers' own cache for it.")
        if self.layers and self.get_seq_length() > 0:
            raise CacheUsageError("bind_config() needs an empty cache: call reset() first.")
        self.config = config
        windows = layer_windows(config)
        self.layers = [PagedLayer(self._group(w, i), i, self.backend) for i, w in enumerate(windows)]
        self.groups.keep({id(layer.group) for layer in self.layers})  # another model's groups go, pages start anew
        attn = getattr(config, "_attn_implementation", None)
        if attn not in (None, ATTN_IMPLEMENTATION):
            warn_gathered_pages()

    def _group(self, sliding_window: int | None, layer_idx: int) -> LayerGroup:
        return self.groups.for_layer(sliding_window, layer_idx, self.page_size, self.max_pages, self.policy,
                                     self.per_layer_eviction, self.kv_format, self.cold_format)

    def _layer(self, layer_idx: int) -> PagedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(PagedLayer(self._group(None, len(self.layers)), len(self.layers), self.backend))
        return self.layers[layer_idx]

    # ----------------------------------------------------------------- steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._plans_ahead or torch.compiler.is_compiling():
            return self._update_compiled(key_states, value_states, layer_idx)
        if self._owner.ident != threading.get_ident():  # (the owner's own steps skip the call)
            self._owner.claim()
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else self._layer(layer_idx)
        group = layer.group
        if group.up_to_date(layer):  # the layer starts new tokens for its group
            if self.groups.step_failed(group):
                self.rollback()  # the last step never reached every layer: a forward failed outside the cache
            elif self.groups.level_with(group):
                self.commit()  # no group has begun this step: a new step of the whole cache, the last one is final
                _refuse_rewind(layer.get_seq_length(), key_states.shape[2], args, kwargs)
                self.groups.plan_together(key_states.shape[0], key_states.shape[2])  # (per-layer groups of full pools)
        try:
            return layer.update(key_states, value_states, *args, **kwargs)
        except Exception:
            self.rollback()  # every group returns to the state before this step
            raise

    def commit(self) -> None:
        """Finish the last step (or roll back a failed one) and hash newly filled pages (not those computed after an
        eviction); with a cold format and no budget they are demoted (`LayerGroups.commit`).

        A step spans every group: it is final only when every layer of every group wrote it;
        otherwise all groups roll back together.
        """
        if self._owner.ident != threading.get_ident() and self.groups.step_open:
            self._owner.claim()  # another thread must not finish (or undo) this thread's step
        if self.groups.step_failed():
            self.rollback()  # the step never reached every layer of every group
            return
        self.groups.commit(None if self.token_log is None else self.token_log.hashes)

    def rollback(self) -> None:
        """Undo the open step of every group (and its tokens in the token log): the cache holds and
        reports exactly what it held before the step."""
        self.groups.rollback()
        if self.token_log is not None:
            self.token_log.truncate(self.groups.num_tokens)

    def _drop_failed_step(self, layer_idx: int) -> None:
        """A query about a layer that already wrote an unfinished step comes from a new forward (a
        layer only asks before it writes, as Llama 4 does): the step failed, roll it back."""
        if layer_idx < len(self.layers) and not torch.compiler.is_compiling() and self._owner.is_mine_or_free():
            group = self.layers[layer_idx].group
            if group.up_to_date(self.layers[layer_idx]) and self.groups.step_failed(group):
                self.rollback()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed by layer ``layer_idx`` (never tokens stored: positions stay right)."""
        self._drop_failed_step(layer_idx)
        return super().get_seq_length(layer_idx)

    # ------------------------------------------------------------------ fork
    def fork(self) -> "PagedCache":
        """A cache holding the same tokens that shares every page with this one, copy-on-write.

        Both caches stay usable and independent: a write into a shared, partly filled page
        copies that page first. ``copy.deepcopy(cache)`` does the same.
        """
        self.commit()
        twin = PagedCache(self.page_size, self.max_pages, backend=self.backend, kv_format=self.kv_format)
        twin.policy, twin.cold_format = self.policy, self.cold_format  # (the shared groups' managers hold the tiers)
        twin.config = self.config
        if self.token_log is not None:
            twin.token_log = copy.deepcopy(self.token_log)
            twin.prefix_hook = PrefixHook(twin, self.prefix_hook.model())
        twin.per_layer_eviction, twin.store_tier = self.per_layer_eviction, self.store_tier  # (indexes are shared)
        twin.groups = self.groups.fork()
        key_of = {id(g): k for k, g in self.groups.items()}
        twin.layers = [layer.fork(twin.groups[key_of[id(layer.group)]]) for layer in self.layers]
        return twin

    def __deepcopy__(self, memo) -> "PagedCache":
        return self.fork()

    def __reduce_ex__(self, protocol):
        raise TypeError(
            "A PagedCache cannot be pickled or saved with torch.save: its pages live in pools shared with its "
            "forks. In this process, copy it with cache.fork() or copy.deepcopy(cache) (pages shared, copy on "
            "write); across processes, keep the token ids and recompute the cache.")

    # ------------------------------------------------------- row operations
    def _remap_rows(self, rows_for) -> None:
        """Replace every group's rows by ``rows_for(old_rows)``, sharing pages (no K/V copy)."""
        self.commit()
        if self.token_log is not None and self.token_log.tokens:
            self.token_log.remap(rows_for(range(len(self.token_log.tokens))))
        self.groups.remap(rows_for)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes old row ``beam_idx[b]``; pages are shared, copied on write."""
        order = _row_indices("reorder_cache", beam_idx, self.groups)
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_positive_int("batch_repeat_interleave: repeats", repeats)
        self._remap_rows(lambda rows: [r for r in rows for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        order = _row_indices("batch_select_indices", indices, self.groups)
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative int); more than the
        cache holds empties it, as `DynamicCache.crop` does."""
        tokens_to_remove = _crop_count(tokens_to_remove)
        self.commit()
        self.groups.crop(-tokens_to_remove)
        if self.token_log is not None:
            self.token_log.truncate(self.get_seq_length())

    def reset(self) -> None:
        """Release every row's pages (hashed pages stay cached for prefix reuse); any thread may then use it."""
        if self._owner.ident is not None:
            self._owner.claim()
        self.commit()
        self.groups.clear()
        for layer in self.layers:
            layer.reset()
        if self.token_log is not None:
            self.token_log.clear()
        self._owner.release()

    def set_max_pages(self, max_pages: int | None) -> None:
        """Change the bound of every layer group: None unbounds it (rows grow again, as after a prompt
        compressed with ``compress_prompt``, when the answer may take all the room it needs); a bound
        below the pages a group holds raises, changing nothing."""
        check_positive_int("max_pages", max_pages, allow_none=True)
        self.commit()
        self.groups.set_max_pages(max_pages)
        self.max_pages = max_pages

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Page and memory accounting, summed over layer groups (``tokens_held``: the most of one group);
        ``kv_bytes`` counts used + cached pages of every layer (cold pages at theirs; `LayerGroups.stats`)."""
        self.commit()
        return dict(page_size=self.page_size, **self.groups.stats(), **self.store_stats())
