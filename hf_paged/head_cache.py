"""`HeadPagedCache`: the `PagedCache` that ``PagedCache(..., per_head_eviction=True)`` makes, whose layers
(`hf_paged.head_eviction.HeadLayer`) keep and evict tokens per KV head.

The rows of a batch advance in lockstep. A step is open from a layer's write until the next step begins (or
`commit`): it is final when every layer wrote it; otherwise (a forward failed outside the cache) every layer rolls
it back, at the next write or question about a layer that wrote it. The layers' tables are stacked (`HeadTables`):
a steady decode step is planned once for all layers, at its first layer's write.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers.cache_utils import Cache

from .cache import PagedCache, _check_arguments, _crop_count, _refuse_rewind, check_cache_arguments
from .errors import CacheUsageError, check_positive_int
from .eviction import EvictionPolicy
from .head_eviction import DEFAULT_HEAD_FLOOR, HeadLayer, refuse_per_head
from .head_tables import HeadTables
from .model_config import ATTN_IMPLEMENTATION, layer_windows


class HeadPagedCache(PagedCache):
    """A bounded cache of one-token pages that evicts per (layer, row, KV head): `hf_paged.head_eviction`.

    Arguments as `PagedCache`'s (``page_size`` must be 1, ``eviction`` "score"); ``max_pages`` bounds each row's
    tokens per layer (``max_pages × kv_heads`` head pages shared by its heads), ``head_floor`` is the share of an even
    split of that budget each head keeps at least (AdaKV's alpha). Not served: prefix caching (``model=``,
    ``prefix_store=``), quantized pages, sliding-window layers, attention sinks (``s_aux``), ``torch.compile``.
    """

    def __init__(self, page_size: int = 1, max_pages: int | None = None, config=None, backend: str | None = None,
                 model=None, eviction: str | EvictionPolicy | None = None, sink_pages: int | None = None,
                 recent_pages: int = 1, lru_threshold: float = 1.0, score_decay: float | None = None,
                 observation_window: int | None = None, score_heads: str | None = None, compress_prompt: bool = False,
                 per_layer_eviction: bool | None = None, score_signal: str | None = None, kv_format: str = "float",
                 prefix_store=None, store_spill: bool = True, cold_format: str | None = None,
                 eviction_interval: int | None = None, per_head_eviction: bool = True, head_floor: float | None = None):
        check_cache_arguments(page_size, max_pages, config, model, backend, lru_threshold, kv_format)
        head_floor = DEFAULT_HEAD_FLOOR if head_floor is None else head_floor
        policy = EvictionPolicy.of(page_size, eviction, sink_pages, recent_pages, lru_threshold, score_decay,
                                   observation_window, score_heads, compress_prompt, score_signal, eviction_interval)
        if eviction_interval is None and not isinstance(eviction, EvictionPolicy):  # (victims chosen every step)
            policy = dataclasses.replace(policy, interval=1)
        refuse_per_head(page_size, policy, (kv_format, cold_format), model, prefix_store, per_layer_eviction,
                        head_floor)
        Cache.__init__(self, layers=[])
        self.page_size, self.max_pages, self.backend, self.kv_format, self.policy = (page_size, max_pages, backend,
                                                                                    kv_format, policy)
        self.head_floor = float(head_floor)
        self.per_layer_eviction = self.per_head_eviction = True
        self.token_log = self.prefix_hook = self.store_tier = None
        self._plans_ahead = False
        self.config, self.tables = None, HeadTables()
        if config is not None:
            self.bind_config(config)

    # ------------------------------------------------------------- structure
    def bind_config(self, config) -> None:
        """One `HeadLayer` per decoder layer (an empty cache only)."""
        _check_arguments(config, None, self.policy.threshold, self.kv_format)
        if any(window is not None for window in layer_windows(config)):
            raise CacheUsageError(f"per_head_eviction serves full-attention layers only; {type(config).__name__} has "
                                  "sliding-window layers. Use per_head_eviction=False for it.")
        attn = getattr(config, "_attn_implementation", None)
        if attn not in (None, ATTN_IMPLEMENTATION):
            raise CacheUsageError(f"per_head_eviction is read by the '{ATTN_IMPLEMENTATION}' attention only (each head "
                                  f"holds its own tokens), the model uses {attn!r}: load it with "
                                  f"attn_implementation='{ATTN_IMPLEMENTATION}' after `import hf_paged`.")
        if self.layers and self.get_seq_length() > 0:
            raise CacheUsageError("bind_config() needs an empty cache: call reset() first.")
        self.config = config
        self.layers = [HeadLayer(self, i) for i in range(len(layer_windows(config)))]

    def _layer(self, layer_idx: int) -> HeadLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(HeadLayer(self, len(self.layers)))
        return self.layers[layer_idx]

    # ----------------------------------------------------------------- steps
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self._layer(layer_idx)
        if layer.undo is not None:  # the layer starts a new step: the last one is final, or failed
            self.commit()
            _refuse_rewind(layer.tokens, key_states.shape[2], args, kwargs)
        try:
            if self.tables.column is None and self._steady(key_states):
                self.tables.plan_step(self.layers, self.max_pages, self.head_floor, self.policy)
            return layer.update(key_states, value_states)
        except Exception:
            self.rollback()
            raise

    def _steady(self, key_states: torch.Tensor) -> bool:
        """A bounded one-token step that no layer has written, every layer at the same length with the keys' rows
        and heads: planned for all layers at once."""
        B, H, q = key_states.shape[:3]
        tables, layers = self.tables, self.layers
        if q != 1 or self.max_pages is None or tables.rows != B * H or H != tables.heads:
            return False
        tokens = layers[0].tokens
        return all(layer.undo is None and layer.heads == H and layer.tokens == tokens and layer.pool is not None
                   for layer in layers)

    def _step_failed(self) -> bool:
        open_ = [layer.undo is not None for layer in self.layers]
        return any(open_) and not all(open_)

    def commit(self) -> None:
        """Finish the open step (roll it back when some layer never wrote it)."""
        if self._step_failed():
            self.rollback()
        self.tables.fold_pending(self.policy.decay)
        for layer in self.layers:
            layer.commit()
        self.tables.drop_column(self.layers)

    def rollback(self) -> None:
        self.tables.fold_pending(self.policy.decay)
        for layer in self.layers:
            layer.rollback()
        self.tables.drop_column(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens processed by layer ``layer_idx`` (a question about a layer that wrote an unfinished step comes from
        a new forward: that step failed and is rolled back)."""
        if layer_idx >= len(self.layers):
            return 0
        if self.layers[layer_idx].undo is not None and self._step_failed():
            self.rollback()
        return self.layers[layer_idx].tokens

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    # --------------------------------------------------------- rows, forks
    def _rows(self) -> int:
        return max((layer.rows // layer.heads for layer in self.layers if layer.heads), default=0)

    def _select(self, name: str, order) -> None:
        self.commit()
        order = torch.as_tensor(order).reshape(-1)
        if order.is_floating_point() or order.dtype == torch.bool:
            raise CacheUsageError(f"{name} takes integer row indices, got a {order.dtype} tensor.")
        order, rows = order.tolist(), self._rows()
        bad = [i for i in order if not 0 <= i < rows]
        if rows and bad:
            raise CacheUsageError(f"{name}: row indices {bad[:5]} are outside [0, {rows}): the cache holds {rows} "
                                  "rows, numbered from 0 (no negative indices).")
        H = self.tables.heads
        if not self.tables.rows or not H:
            return
        index = (np.asarray(order, dtype=np.int64)[:, None] * H + np.arange(H)).reshape(-1)
        for layer in self.layers:
            if layer.heads:
                layer.select_rows(index)
        self.tables.select_rows(index)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row b becomes old row ``beam_idx[b]``; head pages are shared, never copied."""
        self._select("reorder_cache", beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select("batch_select_indices", indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        check_positive_int("batch_repeat_interleave: repeats", repeats)
        self._select("batch_repeat_interleave", [r for r in range(self._rows()) for _ in range(repeats)])

    def fork(self) -> "HeadPagedCache":
        """A cache holding the same tokens, sharing every head page with this one (each evicts on its own)."""
        self.commit()
        twin = HeadPagedCache(1, self.max_pages, backend=self.backend, eviction=self.policy,
                              head_floor=self.head_floor)
        twin.config, twin.tables = self.config, self.tables.copy()
        twin.layers = [layer.twin(twin) for layer in self.layers]
        return twin

    def crop(self, tokens_to_remove: int) -> None:
        tokens_to_remove = _crop_count(tokens_to_remove)
        self.commit()
        length = max(self.get_seq_length() + tokens_to_remove, 0)
        for layer in self.layers:
            layer.crop_to(length)

    def reset(self) -> None:
        self.commit()
        for layer in self.layers:
            layer.clear()
        self.tables.reset(0, 0)

    def set_max_pages(self, max_pages: int | None) -> None:
        """Change the budget (tokens per layer per row); None unbounds it. A budget below what a row holds raises,
        changing nothing."""
        check_positive_int("max_pages", max_pages, allow_none=True)
        self.commit()
        if max_pages is not None:
            held = max((int(layer.held.reshape(-1, layer.heads).sum(1).max()) // layer.heads
                        for layer in self.layers if layer.rows and layer.heads), default=0)
            if held > max_pages:
                raise CacheUsageError(f"set_max_pages({max_pages}): a row holds {held} tokens per head on average in "
                                      "some layer; raise the bound or reset() the cache first.")
        self.max_pages = max_pages

    def reuse_prefix(self, *args, **kwargs):
        raise CacheUsageError("per_head_eviction does no prefix caching.")

    def begin_compiled_step(self, *args, **kwargs):
        raise CacheUsageError("per_head_eviction runs eagerly: do not compile the model with it.")

    # ----------------------------------------------------------------- stats
    def stats(self) -> dict:
        """Head-page accounting: ``tokens_held`` is the most of one layer, summed over rows, each row's tokens being
        its head pages over its kv heads (what ``max_pages`` bounds); ``head_tokens_min/mean/max`` the tokens one
        (layer, row, KV head) holds; ``pages_*`` and ``evictions`` count head pages (a token of one head);
        ``kv_bytes`` the head pages in use, ``pool_bytes`` the pools."""
        self.commit()
        layers = [layer for layer in self.layers if layer.rows and layer.heads]
        pools = {id(layer.pool): layer.pool for layer in layers}.values()
        per_head = np.concatenate([layer.held for layer in layers]) if layers else np.zeros(1, dtype=np.int64)
        return dict(page_size=1, per_head_eviction=True,
                    pages_total=sum(p.manager.num_pages for p in pools),
                    pages_used=sum(p.manager.num_used for p in pools),
                    pages_free=sum(len(p.manager.free) for p in pools), pages_cached=0, prefix_hits=0,
                    tokens_stored=sum(-(-int(layer.held.sum()) // layer.heads) for layer in layers),
                    tokens_held=max((-(-int(layer.held.sum()) // layer.heads) for layer in layers), default=0),
                    head_tokens_min=int(per_head.min()), head_tokens_mean=float(per_head.mean()),
                    head_tokens_max=int(per_head.max()),
                    evictions=sum(layer.evictions for layer in self.layers),
                    kv_bytes=sum(p.manager.num_used * p.pages.page_bytes() for p in pools),
                    pool_bytes=sum(p.pages.num_pages * p.pages.page_bytes() for p in pools))
