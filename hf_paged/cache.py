"""`PagedCache`: a transformers `Cache` whose layers keep K/V in pages under a `BlockManager`."""

from __future__ import annotations

import copy
import inspect

import torch
from transformers.cache_utils import Cache

from .block_manager import BlockManager
from .cache_layer import PagedLayer
from .errors import CacheUsageError
from .eviction import EvictionPolicy, default_policy
from .page_group import PageGroup
from .prefix_cache import TokenLog, install_hook, page_hashes

ATTN_IMPLEMENTATION = "hf_paged"


def _cache_keyword() -> str:
    """How `generate` and model forwards take a cache: ``cache=`` (transformers >= 5.2x), else ``past_key_values=``."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_KWARG = _cache_keyword()  # e.g. model.generate(**inputs, **{hf_paged.CACHE_KWARG: cache})


def _check_positive_int(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        fix = "None (unbounded) or a positive int" if allow_none else "a positive int"
        raise CacheUsageError(f"{name} must be {fix}, got {value!r}.")


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for a layer that keeps every token."""
    text_config = config.get_text_config(decoder=True)
    num_layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    if layer_types is None:
        return [window] * num_layers
    unsupported = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention",
                                                               "chunked_attention")})
    if unsupported:
        raise CacheUsageError(
            f"PagedCache supports attention layers only; this model has layer types {unsupported}. "
            "Use transformers' DynamicCache for it."
        )
    return [window if t == "sliding_attention" else None for t in layer_types]


class PagedCache(Cache):
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
            `PagePoolExhausted`); default "lru", or "score" with ``compress_prompt``; see `hf_paged.eviction`.
        sink_pages / recent_pages: pages never evicted at the start / end of each row.
        lru_threshold: "lru" counts a page as used in a step when its attention share is at least
            this multiple of an even share.
        score_decay: "score" keeps this weight of a page's past score per step (0: the last step only).
        observation_window: the last queries of a step whose attention scores pages.
        compress_prompt: a prompt larger than ``max_pages`` is prefilled whole, then cut to the bound
            by the attention of its last ``observation_window`` tokens (else: raise, feed it in chunks).
        model: bind the cache to this model (implies ``config=model.config``) for prefix caching:
            full pages get content hashes, and a prompt whose leading pages are cached (after
            ``reset()``, or in a fork) computes only its new tokens.

    ``get_seq_length()`` counts tokens processed, never tokens stored, so positions stay right.
    """

    def __init__(self, page_size: int = 16, max_pages: int | None = None, config=None, backend: str | None = None,
                 model=None, eviction: str | None = None, sink_pages: int = 1, recent_pages: int = 1,
                 lru_threshold: float = 1.0, score_decay: float = 0.9, observation_window: int = 32,
                 compress_prompt: bool = False):
        _check_positive_int("page_size", page_size)
        _check_positive_int("max_pages", max_pages, allow_none=True)
        if backend not in (None, "auto", "torch", "triton", "cpu"):
            raise CacheUsageError(f"backend must be 'auto', 'cpu', 'torch' or 'triton', got {backend!r}.")
        self.backend = backend
        self.policy = EvictionPolicy(eviction or default_policy(compress_prompt), sink_pages, recent_pages,
                                     lru_threshold, score_decay, observation_window, compress_prompt)
        super().__init__(layers=[])
        self.page_size = page_size
        self.max_pages = max_pages
        self.groups: dict[int | None, PageGroup] = {}
        self.config = None
        self.token_log: TokenLog | None = None
        if model is not None:
            config = config or model.config
            self.token_log = TokenLog(page_size)
            install_hook(model)
        if config is not None:
            self.bind_config(config)

    # ------------------------------------------------------------- structure
    def bind_config(self, config) -> None:
        """Create one layer per decoder layer, grouped by sliding window."""
        if self.layers and self.get_seq_length() > 0:
            raise CacheUsageError("bind_config() needs an empty cache: call reset() first.")
        self.config = config
        self.layers = [PagedLayer(self._group(w), i, self.backend) for i, w in enumerate(layer_windows(config))]
        attn = getattr(config, "_attn_implementation", None)
        if attn not in (None, ATTN_IMPLEMENTATION):
            import logging

            logging.getLogger(__name__).warning(
                "PagedCache is used with attn_implementation=%r: every step gathers the pages for it "
                "(correct but slower). Load the model with attn_implementation='hf_paged'.", attn)

    def _group(self, sliding_window: int | None) -> PageGroup:
        group = self.groups.get(sliding_window)
        if group is None:
            manager = BlockManager(self.page_size, self.max_pages)
            group = self.groups[sliding_window] = PageGroup(manager, sliding_window, self.policy)
        return group

    def _layer(self, layer_idx: int) -> PagedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(PagedLayer(self._group(None), len(self.layers), self.backend))
        return self.layers[layer_idx]

    # ----------------------------------------------------------------- steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self._layer(layer_idx)
        group = layer.group
        started = layer.seen == group.num_tokens
        try:
            return layer.update(key_states, value_states, *args, **kwargs)
        except Exception:
            if not started:  # a later layer failed mid-step: undo the whole step for the group
                group.abort_step()
            raise

    def commit(self) -> None:
        """Finish the last step (or roll back a failed one) and hash newly filled pages."""
        for group in self.groups.values():
            group._finish_or_rollback()
            if self.token_log is not None:
                group.register_hashes(self.token_log.hashes)

    # -------------------------------------------------------- prefix caching
    def reuse_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """On an empty bound cache: share the longest cached, page-aligned prefix of every row.

        Returns the number of tokens reused (the same for every row, and less than the prompt,
        so at least one token is computed); the prefix hook trims the inputs by that much.
        """
        self.commit()
        if self.get_seq_length() > 0 or not self.groups:
            return 0
        S, length = self.page_size, input_ids.shape[1]
        bits = attention_mask[:, -length:] if attention_mask is not None else torch.ones_like(input_ids)
        rows = [page_hashes(ids, mask, S, 0, b"") for ids, mask in zip(input_ids.tolist(), bits.tolist())]
        pages = min((length - 1) // S, *(len(r) for r in rows))
        while pages > 0 and not all(g.can_restore(rows, pages) for g in self.groups.values()):
            pages -= 1
        if pages == 0:
            return 0
        for group in self.groups.values():
            group.restore(rows, pages)
        for layer in self.layers:
            layer.seen = pages * S
        self.token_log.clear()
        self.token_log.extend(input_ids[:, :pages * S], None if attention_mask is None else bits[:, :pages * S])
        return pages * S

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
        twin.groups = {w: g.fork() for w, g in self.groups.items()}
        twin.layers = [layer.fork(twin.groups[layer.group.sliding_window]) for layer in self.layers]
        return twin

    def __deepcopy__(self, memo) -> "PagedCache":
        return self.fork()

    # ------------------------------------------------------- row operations
    def _remap_rows(self, rows_for) -> None:
        """Replace every group's rows by ``rows_for(old_rows)``, sharing pages (no K/V copy)."""
        self.commit()
        if self.token_log is not None and self.token_log.tokens:
            self.token_log.remap(rows_for(range(len(self.token_log.tokens))))
        for group in (g for g in self.groups.values() if g.rows):  # an empty cache has no rows to remap
            old = group.rows
            new = [list(r) for r in rows_for(old)]
            for r in new:
                group.manager.share_row(r)
            for r in old:
                group.manager.release_row(r)
            group.rows = new
            group.step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes old row ``beam_idx[b]``; pages are shared, copied on write."""
        order = beam_idx.tolist()
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._remap_rows(lambda rows: [r for r in rows for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        order = torch.as_tensor(indices).reshape(-1).tolist()
        self._remap_rows(lambda rows: [rows[i] for i in order])

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (transformers' convention: a negative int)."""
        if tokens_to_remove > 0:
            raise CacheUsageError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as with DynamicCache.")
        self.commit()
        for group in self.groups.values():  # all groups are checked before any is cropped
            group.check_crop(-tokens_to_remove)
        for group in self.groups.values():
            group.crop(-tokens_to_remove)
        if self.token_log is not None:
            self.token_log.truncate(self.get_seq_length())
        for layer in self.layers:
            layer.seen = layer.group.num_tokens

    def reset(self) -> None:
        """Release every row's pages (hashed pages stay cached for prefix reuse)."""
        self.commit()
        for group in self.groups.values():
            group.clear()
        for layer in self.layers:
            layer.reset()
        if self.token_log is not None:
            self.token_log.clear()

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Page and memory accounting; ``kv_bytes`` counts used + cached pages of every layer."""
        self.commit()
        out = dict(page_size=self.page_size, pages_total=0, pages_used=0, pages_free=0, pages_cached=0,
                   tokens_stored=0, kv_bytes=0, pool_bytes=0, evictions=0, prefix_hits=0)
        for group in self.groups.values():
            m = group.manager
            out["pages_total"] += m.num_pages
            out["pages_used"] += m.num_used
            out["pages_free"] += len(m.free)
            out["pages_cached"] += len(m.cached)
            out["tokens_stored"] += group.tokens_stored()
            out["evictions"] += group.evictions
            out["prefix_hits"] += group.prefix_hits
            for layer in group.layers:
                if layer.is_initialized:
                    page_bytes = sum(t[0].numel() * t.element_size() for t in (layer.keys, layer.values))
                    out["kv_bytes"] += (m.num_used + len(m.cached)) * page_bytes
                    out["pool_bytes"] += page_bytes * layer.keys.shape[0]
        return out
