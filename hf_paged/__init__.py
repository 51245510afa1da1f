"""hf_paged: a paged KV cache with an LRU block manager for Hugging Face transformers.

``import hf_paged`` registers the "hf_paged" attention and mask functions, so that

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_paged")
    model.generate(**inputs, past_key_values=hf_paged.PagedCache(page_size=16))

reads keys and values from pages in place.
"""

from .attention import paged_attention_forward, register
from .block_manager import BlockManager
from .cache import PagedCache
from .continuous_batching import generate_many, stream_many
from .cpu_weights import pack_linear_weights, packed_linear_weights, unpack_linear_weights
from .errors import CacheUsageError, PagePoolExhausted
from .model_config import ATTN_IMPLEMENTATION, CACHE_KWARG
from .prefix_store import open_store
from .ragged_cache import RaggedCache

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CACHE_KWARG",
    "BlockManager",
    "CacheUsageError",
    "PagePoolExhausted",
    "PagedCache",
    "RaggedCache",
    "generate_many",
    "open_store",
    "stream_many",
    "pack_linear_weights",
    "packed_linear_weights",
    "unpack_linear_weights",
    "paged_attention_forward",
]
__version__ = "0.1.0"
