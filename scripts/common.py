"""What the comparison scripts share: the two caches they compare, their KV bytes, argument and number formats.

The scripts run as ``python scripts/NAME.py``, which puts this folder on ``sys.path``; the tests get it
from ``pythonpath = scripts`` in setup.cfg.
"""

from __future__ import annotations

import argparse

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


def int_list(text: str) -> list[int]:
    """argparse type: comma-separated positive ints, e.g. "256,1024"."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def mib(nbytes, digits: int = 1) -> str:
    """Bytes as MiB with ``digits`` decimals."""
    return f"{nbytes / 2**20:.{digits}f}"
