"""hf_paged: a paged KV cache for Hugging Face transformers, its pages under a block manager that evicts
what attention relies on least when bounded (docs/eviction.md).

``import hf_paged`` registers the "hf_paged" attention and mask functions, so that

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="hf_paged")
    model.generate(**inputs, cache=hf_paged.PagedCache(page_size=16))  # past_key_values= before 5.24

reads keys and values from pages in place.
"""

from .attention import paged_attention_forward, register
from .block_manager import BlockManager
from .cache import PagedCache
from .compiled import plan_compiled_steps
from .compiled_many import compile_many_steps
from .continuous_batching import generate_many, stream_many
from .cpu_weights import pack_linear_weights, packed_linear_weights, unpack_linear_weights
from .errors import CacheUsageError, PagePoolExhausted
from .generation_options import ManyOutput
from .head_cache import HeadPagedCache
from .model_config import ATTN_IMPLEMENTATION, CACHE_KWARG
from .prefix_store import open_store
from .ragged_cache import RaggedCache
from .stats import GenerationStats

register()
PagedCache.per_head_class = HeadPagedCache  # what PagedCache(per_head_eviction=True) makes (cache.py: CacheVariant)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CACHE_KWARG",
    "BlockManager",
    "CacheUsageError",
    "GenerationStats",
    "ManyOutput",
    "PagePoolExhausted",
    "PagedCache",
    "plan_compiled_steps",
    "compile_many_steps",
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
