"""A prefix store shared by processes, runs and machines: full, hashed KV pages on disk or in Redis.

    store = open_store("file:///var/cache/kv")          # or "redis://host:6379/0", or a plain path
    layout = PageLayout.create(model_fingerprint=..., dtype=..., page_size=16, layer_windows=[...],
                               device_type="cpu", page_format="kv", layout_version=1,
                               tensors={"k.0": ((16, 3, 64), torch.float32), ...})
    store.put(layout, hashes, tensors)          # pages 0.. of a sequence: tensors [pages, *shape]
    found = store.contains_prefix(layout, hashes)
    if store.decide_load(found * layout.page_bytes, found * 16, prefill_tokens_per_s).load:
        runs = store.get(layout, hashes[:found])   # verified PageRuns, in order

See docs/prefix_store.md for formats, keys, guarantees and the GPU tiering design.
"""

from .base import PageRun, PrefixStore, RunStore
from .disk import DiskStore
from .errors import StoreUnavailable, UnsafeStoreDirectory
from .layout import PageLayout, TensorSpec, store_namespace
from .load_policy import LoadDecision, ReadBandwidth, decide
from .redis_server import LocalRedisServer, find_redis_server
from .redis_store import RedisStore
from .stats import COUNTERS
from .uri import open_store, parse_size
from .writer import BackgroundWriter

__all__ = [
    "COUNTERS", "BackgroundWriter", "DiskStore", "LoadDecision", "LocalRedisServer", "PageLayout", "PageRun",
    "PrefixStore", "ReadBandwidth", "RedisStore", "RunStore", "StoreUnavailable", "TensorSpec",
    "UnsafeStoreDirectory", "decide", "find_redis_server", "open_store", "parse_size", "store_namespace",
]
