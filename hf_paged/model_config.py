"""What hf_paged reads off a model and transformers: its attention name, the cache keyword, the layers' windows."""

from __future__ import annotations

import inspect

from .errors import CacheUsageError

ATTN_IMPLEMENTATION = "hf_paged"


def _cache_keyword() -> str:
    """How `generate` and model forwards take a cache: ``cache=`` (transformers >= 5.2x), else ``past_key_values=``."""
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


CACHE_KWARG = _cache_keyword()  # e.g. model.generate(**inputs, **{hf_paged.CACHE_KWARG: cache})


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: how many recent tokens it may attend (None: every token).

    A ``chunked_attention`` layer (Llama 4) attends within its chunk of ``attention_chunk_size``
    tokens, so, as transformers' own caches do, it keeps a window of that size; the mask (built by
    transformers) restricts it to the chunk.
    """
    text_config = config.get_text_config(decoder=True)
    num_layers = text_config.num_hidden_layers
    layer_types = getattr(text_config, "layer_types", None)
    window = getattr(text_config, "sliding_window", None)
    chunk = getattr(text_config, "attention_chunk_size", None)
    if layer_types is None:
        return [window or chunk] * num_layers
    unsupported = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention",
                                                               "chunked_attention")})
    if unsupported:
        raise CacheUsageError(
            f"PagedCache supports attention layers only; this model has layer types {unsupported}. "
            "Use transformers' DynamicCache for it."
        )
    by_type = {"sliding_attention": window, "chunked_attention": chunk}
    return [by_type.get(t) for t in layer_types]


def head_dim(config) -> int | None:
    """The attention head dim of a model config (``head_dim``, else hidden size / query heads), None if unknown."""
    text_config = config.get_text_config(decoder=True)
    dim = getattr(text_config, "head_dim", None)
    if dim is None and getattr(text_config, "num_attention_heads", None):
        dim = getattr(text_config, "hidden_size", 0) // text_config.num_attention_heads or None
    return dim


def kv_heads_and_dim(config) -> tuple[int, int | None]:
    """(key/value heads, head dim) of the decoder's attention layers, as the config states them."""
    text_config = config.get_text_config(decoder=True)
    return getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads, head_dim(config)
