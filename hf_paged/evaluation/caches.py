"""The two caches the studies compare, and what they hold, read through their public APIs.

``"dynamic"``: transformers' `DynamicCache` with "sdpa" attention (the reference); ``"paged"``:
`hf_paged.PagedCache` with "hf_paged" attention.
"""

from __future__ import annotations

# The attention implementation each cache is compared with.
ATTN = {"dynamic": "sdpa", "paged": "hf_paged"}


def make_cache(kind: str, model, page_size: int, **paged_kwargs):
    """A fresh ``DynamicCache`` (``kind="dynamic"``) or ``PagedCache(page_size, **paged_kwargs)`` for ``model``."""
    import transformers

    import hf_paged

    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    return hf_paged.PagedCache(page_size=page_size, config=model.config, **paged_kwargs)


def use_attention(model, kind: str) -> None:
    """Switch ``model`` to the attention implementation ``kind``'s cache is compared with."""
    model.set_attn_implementation(ATTN[kind])
    if model.config._attn_implementation != ATTN[kind]:
        raise RuntimeError(f"could not switch the model to attn_implementation={ATTN[kind]!r}")


def dynamic_kv_bytes(cache) -> int:
    """Bytes of every initialized layer's keys and values in a ``DynamicCache``."""
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and getattr(layer, "is_initialized", True):
                total += t.numel() * t.element_size()
    return total


def kv_bytes(cache) -> tuple[int, int]:
    """(KV bytes held, bytes allocated): equal for a ``DynamicCache``; the used + cached pages and the page pool
    (``stats()["kv_bytes"]``, ``["pool_bytes"]``) for a ``PagedCache``."""
    import hf_paged

    if isinstance(cache, hf_paged.PagedCache):
        stats = cache.stats()
        return stats["kv_bytes"], stats["pool_bytes"]
    held = dynamic_kv_bytes(cache)
    return held, held


def tokens_held(cache) -> int:
    """Tokens a cache holds per layer: ``stats()["tokens_held"]`` of a ``PagedCache`` (the most of one layer group,
    summed over rows), the first layer's length of a ``DynamicCache`` (one row)."""
    import hf_paged

    if isinstance(cache, hf_paged.PagedCache):
        return cache.stats()["tokens_held"]
    layer = cache.layers[0]
    return int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0


def cache_rows(cache) -> int:
    """Rows a cache holds (batch x beams, or x returned sequences). For an unbounded ``PagedCache`` with a
    full-attention layer: the tokens its fullest group holds over the tokens each row processed."""
    import hf_paged

    if isinstance(cache, hf_paged.PagedCache):
        return cache.stats()["tokens_held"] // cache.get_seq_length()
    return cache.layers[0].keys.shape[0]
