"""num_return_sequences: sampled rows match DynamicCache and store each prompt once."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import left_padded_batch, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_parallel_samples_store_each_prompt_once(name):
    ref, paged = shared_pair(name)
    batch = left_padded_batch((9, 5))
    n, page_size = 4, 4
    sample = dict(do_sample=True, num_return_sequences=n, temperature=1.3, top_k=30, pad_token_id=0,
                  eos_token_id=None)
    torch.manual_seed(7)
    want = ref.generate(**batch, **sample, max_new_tokens=10, cache=DynamicCache(config=ref.config))
    torch.manual_seed(7)
    cache = hf_paged.PagedCache(page_size=page_size, config=paged.config)
    got = paged.generate(**batch, **sample, max_new_tokens=10, cache=cache)
    assert torch.equal(got, want)
    check_pages(cache)
    total = batch["input_ids"].shape[1] + 9
    assert cache.stats()["pages_used"] < len(cache.groups) * 2 * n * math.ceil(total / page_size)

    # right after prefill: 2 distinct prompts, each stored once, whatever n is
    cache = hf_paged.PagedCache(page_size=page_size, config=paged.config)
    paged.generate(**batch, **sample, max_new_tokens=1, cache=cache)
    width = batch["input_ids"].shape[1]
    stats = cache.stats()
    assert stats["pages_used"] == len(cache.groups) * 2 * math.ceil(width / page_size), stats
    for group in cache.groups.values():
        assert len(group.rows) == 2 * n
        assert all(group.rows[b] == group.rows[b - b % n] for b in range(2 * n))
        assert group.rows[0] != group.rows[n]
    check_pages(cache)

