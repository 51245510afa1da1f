"""`PagedCache`: a transformers `Cache` whose layers keep K/V in pages under a `BlockManager`."""

from __future__ import annotations

import copy
import numbers

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache

from .cache_layer import PagedLayer
from .errors import CacheUsageError
from .eviction import EvictionPolicy
from .model_config import ATTN_IMPLEMENTATION, layer_windows
from .page_group import PageGroup
from .page_groups import PageGroups
from .paged_kv import warn_gathered_pages
from .prefix_cache import TokenLog
from .prefix_hook import PrefixCaching, PrefixHook
from .thread_owner import ThreadOwner

MAX_PAGE_SIZE = 2**16  # tokens; a page is the unit of allocation (typical sizes: 16 to 256)


def _check_positive_int(name: str, value, allow_none: bool = False, most: int | None = None) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or (most is not None and value > most):
        fix = "None (unbounded) or a positive int" if allow_none else "a positive int"
        fix += f" of at most {most}" if most is not None else ""
        raise CacheUsageError(f"{name} must be {fix}, got {value!r}.")


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


def _check_backend(backend) -> None:
    if backend not in (None, "auto", "torch", "triton", "cpu"):
        raise CacheUsageError(f"backend must be 'auto', 'cpu', 'torch' or 'triton', got {backend!r}.")


def _check_arguments(config, model, lru_threshold) -> None:
    """Types that would otherwise fail later with an AttributeError or TypeError."""
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


class PagedCache(PrefixCaching, Cache):
    """A paged KV cache for ``model.generate`` (``past_key_values=`` or ``cache=``).

    Args:
        page_size: tokens per page, any positive int.
        max_pages: pages per layer group; None lets the pool grow (geometrically, +25% at a time).
        config: the model config; builds sliding-window layers up front (their pages are freed
            as they leave the window) and checks the attention implementation.
        backend: "cpu" (the C kernel, for CPU tensors), "triton" (the Triton kernel; CUDA, or CPU with
            TRITON_INTERPRET=1), "torch" (SDPA on page views) or "auto" (Triton on CUDA, the C kernel
            on the CPU); default ``$HF_PAGED_BACKEND`` or "auto".
        eviction: what a bounded pool does when full: "score", "lru", "fifo" or "error" (raise
            `PagePoolExhausted`); default "score"; see `hf_paged.eviction`.
        sink_pages / recent_pages: pages never evicted at the start / end of each row (default sinks: the
            pages of the first 4 tokens, StreamingLLM's attention sinks).
        lru_threshold: "lru" counts a page as used in a step when its attention share is at least
            this multiple of an even share.
        score_decay: "score" keeps this weight of a page's past score per step (0: the last step only).
        observation_window: the last queries of a step whose attention scores pages.
        score_heads / score_signal: the heads' "mean" or "max"; a page's "attention", or the "output" it would move
            if dropped (these four default by page size: `hf_paged.eviction.usage_signal_defaults`).
        compress_prompt: a prompt larger than ``max_pages`` is prefilled whole, then cut to the bound
            by the attention of its last ``observation_window`` tokens (else: raise, feed it in chunks).
        per_layer_eviction: each layer keeps its own pages and evicts by its own attention (the default
            for a bounded "score" or "lru" cache); False: the layers of a group share one page table.
        model: bind the cache to this model (implies ``config=model.config``) for prefix caching:
            full pages get content hashes, and a prompt whose leading pages are cached (after
            ``reset()``, or in a fork) computes only its new tokens.

    ``get_seq_length()`` counts tokens processed, never tokens stored, so positions stay right.
    """

    def __init__(self, page_size: int = 16, max_pages: int | None = None, config=None, backend: str | None = None,
                 model=None, eviction: str | None = None, sink_pages: int | None = None, recent_pages: int = 1,
                 lru_threshold: float = 1.0, score_decay: float | None = None, observation_window: int | None = None,
                 score_heads: str | None = None, compress_prompt: bool = False, per_layer_eviction: bool | None = None, score_signal: str | None = None):
        _check_positive_int("page_size", page_size, most=MAX_PAGE_SIZE)
        _check_positive_int("max_pages", max_pages, allow_none=True)
        _check_arguments(config, model, lru_threshold)
        _check_backend(backend)
        self.backend = backend
        self.policy = EvictionPolicy.for_pages(page_size, eviction, sink_pages, recent_pages, lru_threshold, score_decay,
                                               observation_window, score_heads, compress_prompt, score_signal)
        super().__init__(layers=[])
        self.page_size = page_size
        self.max_pages = max_pages
        self.per_layer_eviction = (max_pages is not None and self.policy.tracks_usage if per_layer_eviction is None
                                   else bool(per_layer_eviction))
        self.groups = PageGroups()
        self._owner = ThreadOwner()
        self.config = None
        self.token_log: TokenLog | None = None
        self.prefix_hook: PrefixHook | None = None
        if model is not None:
            config = config or model.config
            self.token_log = TokenLog(page_size)
            self.prefix_hook = PrefixHook(self, model)
        if config is not None:
            self.bind_config(config)

    # ------------------------------------------------------------- structure
    def bind_config(self, config) -> None:
        """Create one layer per decoder layer, grouped by sliding window (on an empty cache: also to
        serve another model after ``reset()``)."""
        _check_arguments(config, None, self.policy.threshold)
        if getattr(config, "is_encoder_decoder", False):
            raise CacheUsageError(
                f"PagedCache supports decoder-only models; {type(config).__name__} is an encoder-decoder model "
                "(its cross-attention keys would share the cache). Use transformers' own cache for it.")
        if self.layers and self.get_seq_length() > 0:
            raise CacheUsageError("bind_config() needs an empty cache: call reset() first.")
        self.config = config
        windows = layer_windows(config)
        self.layers = [PagedLayer(self._group(w, i), i, self.backend) for i, w in enumerate(windows)]
        self.groups.keep({id(layer.group) for layer in self.layers})  # another model's groups go
        attn = getattr(config, "_attn_implementation", None)
        if attn not in (None, ATTN_IMPLEMENTATION):
            warn_gathered_pages()

    def _group(self, sliding_window: int | None, layer_idx: int) -> PageGroup:
        return self.groups.for_layer(sliding_window, layer_idx, self.page_size, self.max_pages, self.policy,
                                     self.per_layer_eviction)

    def _layer(self, layer_idx: int) -> PagedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(PagedLayer(self._group(None, len(self.layers)), len(self.layers), self.backend))
        return self.layers[layer_idx]

    # ----------------------------------------------------------------- steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._owner.claim()
        layer = self._layer(layer_idx)
        group = layer.group
        if group.up_to_date(layer):  # the layer starts new tokens for its group
            if self.groups.step_failed(group):
                self.rollback()  # the last step never reached every layer: a forward failed outside the cache
            elif self.groups.level_with(group):
                self.commit()  # no group has begun this step: a new step of the whole cache, the last one is final
                _refuse_rewind(self.get_seq_length(layer_idx), key_states.shape[2], args, kwargs)
        try:
            return layer.update(key_states, value_states, *args, **kwargs)
        except Exception:
            self.rollback()  # every group returns to the state before this step
            raise

    def commit(self) -> None:
        """Finish the last step (or roll back a failed one) and hash newly filled pages (not those computed after an
        eviction).

        A step spans every group: it is final only when every layer of every group wrote it;
        otherwise all groups roll back together.
        """
        if self.groups.step_open:
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
        if layer_idx < len(self.layers) and self._owner.is_mine_or_free():
            group = self.layers[layer_idx].group
            if group.up_to_date(self.layers[layer_idx]) and self.groups.step_failed(group):
                self.rollback()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed by layer ``layer_idx`` (never tokens stored: positions stay right)."""
        self._drop_failed_step(layer_idx)
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._drop_failed_step(layer_idx)
        return super().get_mask_sizes(query_length, layer_idx)

    # ------------------------------------------------------------------ fork
    def fork(self) -> "PagedCache":
        """A cache holding the same tokens that shares every page with this one, copy-on-write.

        Both caches stay usable and independent: a write into a shared, partly filled page
        copies that page first. ``copy.deepcopy(cache)`` does the same.
        """
        self.commit()
        twin = PagedCache(self.page_size, self.max_pages, backend=self.backend)
        twin.policy = self.policy
        twin.config = self.config
        if self.token_log is not None:
            twin.token_log = copy.deepcopy(self.token_log)
            twin.prefix_hook = PrefixHook(twin, self.prefix_hook.model())
        twin.per_layer_eviction = self.per_layer_eviction
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

    def _row_indices(self, name: str, indices) -> list[int]:
        """``indices`` as rows of this cache, else a clear error (a negative index would silently wrap around)."""
        order = torch.as_tensor(indices).reshape(-1)
        if order.is_floating_point() or order.is_complex() or order.dtype == torch.bool:
            raise CacheUsageError(f"{name} takes integer row indices, got a {order.dtype} tensor.")
        order = order.tolist()
        batch = max((group.batch_size for group in self.groups.values()), default=0)
        bad = [i for i in order if not 0 <= i < batch]
        if batch and bad:
            raise CacheUsageError(f"{name}: row indices {bad[:5]} are outside [0, {batch}): the cache holds {batch} "
                                  "rows, numbered from 0 (no negative indices).")
        return order

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes old row ``beam_idx[b]``; pages are shared, copied on write."""
        order = self._row_indices("reorder_cache", beam_idx)
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def batch_repeat_interleave(self, repeats: int) -> None:
        _check_positive_int("batch_repeat_interleave: repeats", repeats)
        self._remap_rows(lambda rows: [r for r in rows for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        order = self._row_indices("batch_select_indices", indices)
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative int); more than the
        cache holds empties it, as `DynamicCache.crop` does."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral) \
                or tokens_to_remove > 0:
            raise CacheUsageError(
                f"crop({tokens_to_remove!r}): pass a negative int, the number of tokens to remove, as with "
                "DynamicCache.")
        tokens_to_remove = int(tokens_to_remove)
        self.commit()
        self.groups.crop(-tokens_to_remove)
        if self.token_log is not None:
            self.token_log.truncate(self.get_seq_length())

    def reset(self) -> None:
        """Release every row's pages (hashed pages stay cached for prefix reuse); any thread may then use
        the cache."""
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
        _check_positive_int("max_pages", max_pages, allow_none=True)
        self.commit()
        self.groups.set_max_pages(max_pages)
        self.max_pages = max_pages

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Page and memory accounting, summed over layer groups (``tokens_held``: the most of one group);
        ``kv_bytes`` counts used + cached pages of every layer."""
        self.commit()
        return dict(page_size=self.page_size, **self.groups.stats())
