"""The two caches the studies compare, and what they hold, read through their public APIs.

``"dynamic"``: transformers' `DynamicCache` with "sdpa" attention (the reference); ``"paged"``:
`hf_paged.PagedCache` with "hf_paged" attention. `StudyStore`: the prefix store of a script's ``--prefix-store``,
shared by every cache the study makes, and their store counters.
"""

from __future__ import annotations

# The attention implementation each cache is compared with.
ATTN = {"dynamic": "sdpa", "paged": "hf_paged"}


def make_cache(kind: str, model, page_size: int, store: "StudyStore | None" = None, **paged_kwargs):
    """A fresh ``DynamicCache`` (``kind="dynamic"``) or ``PagedCache(page_size, **paged_kwargs)`` for ``model``;
    with a ``store`` that holds one, the PagedCache reads and writes its prefix store (`StudyStore.cache_kwargs`)."""
    import transformers

    import hf_paged

    if kind == "dynamic":
        return transformers.DynamicCache(config=model.config)
    if store is not None:
        paged_kwargs.update(store.cache_kwargs(model))
    return hf_paged.PagedCache(page_size=page_size, config=model.config, **paged_kwargs)


class StudyStore:
    r"""The prefix store named by a script's ``--prefix-store`` (a folder, ``file:///dir`` or ``redis://...``; None:
    no store), opened once with background writes and shared by every cache the study makes (so its entries are
    written once and a later cache or run loads them), and the store counters of the caches `add`\ ed.

    Invariant: ``totals`` is the sum over the added caches of their ``store_*`` counters (``store_decision``: the
    last added cache's that made one, ``caches``: how many were added).
    """

    def __init__(self, uri: str | None):
        import hf_paged

        self.uri = uri
        self.store = None if uri is None else hf_paged.open_store(uri, background=True)
        self.totals: dict = {}

    def cache_kwargs(self, model) -> dict:
        """The arguments that make a cache for ``model`` use the store: ``model=`` (prefix caching, which hashes
        the pages a store holds) and ``prefix_store=``; none without a store. (A `RaggedCache` takes
        ``prefix_store=self.store`` alone.)"""
        return {} if self.store is None else dict(model=model, prefix_store=self.store)

    def add(self, cache) -> dict:
        """Wait for the store's queued writes and add ``cache``'s store counters to the totals; -> its counters."""
        if self.store is None:
            return {}
        self.store.flush()
        counters = {k: v for k, v in cache.stats().items() if k.startswith("store_")}
        for key, value in counters.items():
            if key == "store_decision":
                self.totals[key] = value if value is not None else self.totals.get(key)
            else:
                self.totals[key] = self.totals.get(key, 0) + value
        self.totals["caches"] = self.totals.get("caches", 0) + 1
        return counters

    def close(self, label: str) -> dict | None:
        """Close the store and print its totals (``label``: whose they are); -> the totals with the URI (None
        without a store)."""
        if self.store is None:
            return None
        self.store.close()
        report = dict(uri=self.uri, **self.totals)
        print(f"{label} prefix store {store_text(report)}")
        return report


def store_text(report: dict) -> str:
    """A `StudyStore.close` report in one line: the URI and every counter."""
    return f"{report['uri']}: " + ", ".join(f"{k}={v}" for k, v in report.items() if k != "uri")


def use_attention(model, kind: str) -> None:
    """Switch ``model`` to the attention implementation ``kind``'s cache is compared with: "sdpa" for
    ``"dynamic"``, "hf_paged" for every paged kind ("paged", "bounded", ...)."""
    attn = ATTN["dynamic"] if kind == "dynamic" else ATTN["paged"]
    model.set_attn_implementation(attn)
    if model.config._attn_implementation != attn:
        raise RuntimeError(f"could not switch the model to attn_implementation={attn!r}")


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
