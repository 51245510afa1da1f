"""The prefix store under both caches (issue 33): write-through, loads on a miss, spill, keys, faults.

Every test compares greedy tokens with a run without a store: a store may only save work, never change output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from prefix_store_cases import store_warnings
from tiny_models import make_pair

import hf_paged
from hf_paged import CacheUsageError, PagedCache, RaggedCache, generate_many, open_store

PAGE = 8
PROMPT = [1] + [(7 * i) % 90 + 3 for i in range(44)]  # 45 tokens: 5 full pages, 5 reusable (one token is computed)
OTHER = [1] + [(11 * i) % 90 + 3 for i in range(44)]


@pytest.fixture
def model():
    return make_pair("llama")[1]


def generate(model, cache, prompt=PROMPT, new=6):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         **{hf_paged.CACHE_KWARG: cache}, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference(model, prompt=PROMPT, new=6):
    return generate(model, PagedCache(page_size=PAGE), prompt, new)


def stored(cache) -> dict:
    cache.prefix_store.flush()
    return cache.stats()


def test_paged_cache_writes_through_and_a_fresh_cache_loads_every_page(model, tmp_path):
    want = reference(model)
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    assert generate(model, first) == want
    stats = stored(first)
    assert stats["store_pages_written"] >= 5 and stats["store_bytes_written"] > 0 and stats["store_hits"] == 0
    again = PagedCache(page_size=PAGE, model=model, prefix_store=f"file://{tmp_path}")
    assert generate(model, again) == want
    stats = again.stats()
    assert stats["store_hits"] == stats["store_pages_read"] == 5 and stats["store_misses"] == 0
    assert stats["prefix_hits"] == 5 and stats["store_bytes_read"] > 0 and stats["store_load_seconds"] > 0


def test_a_store_object_is_shared_by_caches_and_open_store_is_exported(model, tmp_path):
    store = hf_paged.open_store(tmp_path, background=True)
    want = reference(model)
    assert generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=store)) == want
    store.flush()
    cache = PagedCache(page_size=PAGE, model=model, prefix_store=store)
    assert cache.prefix_store is store and generate(model, cache) == want and cache.stats()["store_hits"] == 5
    store.close()


def test_zero_hits_when_a_weight_the_dtype_or_the_page_size_changes(model, tmp_path):
    generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path)))
    open_store(tmp_path).close()
    other_size = PagedCache(page_size=PAGE // 2, model=model, prefix_store=str(tmp_path))
    generate(model, other_size)
    with torch.no_grad():  # one weight the fingerprint does not sample
        layer = model.model.layers[1].mlp.down_proj.weight
        layer[5, 7] += 0.25
    changed = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    assert generate(model, changed) == reference(model)
    half = make_pair("llama")[1].to(torch.bfloat16)
    cast = PagedCache(page_size=PAGE, model=half, prefix_store=str(tmp_path))
    assert generate(half, cast) == reference(half)
    for cache in (other_size, changed, cast):
        assert cache.stats()["store_hits"] == 0 and cache.stats()["store_pages_read"] == 0


def test_a_corrupted_or_truncated_entry_is_recomputed_with_one_warning(model, tmp_path):
    want = reference(model)
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    generate(model, first)
    stored(first)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data = data[:len(data) // 2]
        else:
            data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
        assert generate(model, cache) == want
        assert generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=cache.prefix_store)) == want
    assert len(store_warnings(caught)) == 1
    assert cache.stats()["store_rejected"] >= 1 and cache.stats()["store_pages_read"] == 0

