"""batch_repeat_interleave / batch_select_indices: rows share pages and read like DynamicCache's rows."""

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
def test_batch_repeat_interleave_and_select_indices_read_like_dynamic_cache(name):
    ref, paged = shared_pair(name)
    batch = left_padded_batch((9, 5, 7))
    dyn = DynamicCache(config=ref.config)
    cache = hf_paged.PagedCache(page_size=3, config=paged.config)
    with torch.no_grad():
        ref(**batch, cache=dyn)
        paged(**batch, cache=cache)
    before = cache.stats()["pages_used"]
    select = torch.tensor([5, 0, 2, 3])  # rows 2, 0, 1, 1 of the prompt batch
    for c in (dyn, cache):
        c.batch_repeat_interleave(2)
    assert cache.stats()["pages_used"] == before  # the repeated rows share pages
    check_pages(cache)
    for c in (dyn, cache):
        c.batch_select_indices(select)
    assert cache.stats()["pages_used"] == before
    check_pages(cache)
    mask = torch.cat([batch["attention_mask"].repeat_interleave(2, 0)[select], torch.ones(4, 1, dtype=torch.long)], 1)
    step = torch.tensor([[5], [6], [7], [8]])
    with torch.no_grad():
        want = ref(input_ids=step, attention_mask=mask, cache=dyn).logits
        got = paged(input_ids=step, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for dyn_layer, layer in zip(dyn.layers, cache.layers):
        keys, values = layer.read()  # [B, T, H, D]; DynamicCache: [B, H, T, D]
        want_k, want_v = dyn_layer.keys.transpose(1, 2), dyn_layer.values.transpose(1, 2)
        keys, values = keys[:, -want_k.shape[1]:], values[:, -want_k.shape[1]:]
        real = mask[:, -want_k.shape[1]:].bool()  # padding slots differ between attention implementations
        torch.testing.assert_close(keys[real], want_k[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[real], want_v[real], atol=1e-5, rtol=1e-5)
    check_pages(cache)
    # keeping one of the three prompts releases the other two's pages
    cache.batch_select_indices(torch.tensor([1]))
    prompt_pages = math.ceil(batch["input_ids"].shape[1] / 3)
    assert cache.stats()["pages_used"] <= len(cache.groups) * (prompt_pages + 1)
    check_pages(cache)



def test_row_operations_on_an_empty_cache_do_nothing_like_dynamic_cache():
    caches = []
    for cache in (DynamicCache(), hf_paged.PagedCache(page_size=2)):
        cache.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2), 0)
        cache.reset()
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.batch_select_indices(torch.tensor([1]))
        cache.batch_repeat_interleave(2)
        assert cache.get_seq_length() == 0
        cache.update(torch.ones(3, 1, 1, 2), torch.ones(3, 1, 1, 2), 0)  # any batch size, as after reset
        caches.append(cache)
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 1
