"""crop() at the edges and row indices out of range (issue 30, items 6 and 9): cropping as many tokens as the cache
holds, or more, empties it as `DynamicCache.crop` does (never a negative length); a positive int is refused as
DynamicCache refuses it; a crop into a hashed page drops the page's hash (its content changes); row indices of
`reorder_cache` / `batch_select_indices` outside the batch are refused, not wrapped around."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import left_padded_batch, make_pair, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("extra", [0, 1, 30])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_cropping_everything_empties_the_cache_as_dynamic_cache_does(name, extra):
    """14 tokens (gemma3: its sliding group already freed pages), then crop(-(14 + extra)): the cache is empty, as
    a DynamicCache of full layers is, and the next batch (of another size) gets the logits of a fresh cache."""
    ref, paged = shared_pair(name)
    batch, second = left_padded_batch((13, 9)), left_padded_batch((6, 11, 4), seed=1)
    cache = hf_paged.PagedCache(page_size=2, config=paged.config)
    with torch.no_grad():
        paged(**batch, cache=cache)
        paged(input_ids=torch.tensor([[5], [6]]), attention_mask=torch.ones(2, 14, dtype=torch.long), cache=cache)
        cache.crop(-(14 + extra))
        assert cache.get_seq_length() == 0 and cache.stats()["pages_used"] == 0
        got = paged(**second, cache=cache).logits
        want = ref(**second).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert cache.get_seq_length() == 11 and all(g.num_tokens == 11 for g in cache.groups.values())
    check_pages(cache)
    if name == "llama":  # DynamicCache's own semantics, which crop follows
        dynamic = DynamicCache(config=ref.config)
        ref(**batch, cache=dynamic)
        dynamic.crop(-(13 + extra))
        assert dynamic.get_seq_length() == 0


def test_cropping_everything_of_a_bound_cache_keeps_prefix_reuse_exact():
    ref, paged = make_pair("llama")
    prompt = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(2))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    want = ref.generate(prompt, **kwargs)
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    paged.generate(prompt, **kwargs, cache=cache)
    cache.crop(-100)
    assert cache.get_seq_length() == 0 and cache.token_log.tokens == []
    assert torch.equal(paged.generate(prompt, **kwargs, cache=cache), want)
    assert cache.stats()["prefix_hits"] == 3  # the prompt's three full pages, kept cached through the crop


@pytest.mark.parametrize("value", [3, 0.0, -2.0, True])
def test_a_crop_that_is_not_a_negative_int_is_refused_as_by_dynamic_cache(value):
    _, paged = shared_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    paged(input_ids=torch.tensor([[5, 6, 7]]), cache=cache)
    with pytest.raises(ValueError, match="pass a negative int"):
        cache.crop(value)
    if value == 3:
        with pytest.raises(ValueError, match="positive value"):
            DynamicCache(config=paged.config).crop(value)
    assert cache.get_seq_length() == 3


def test_a_crop_into_a_hashed_page_drops_its_hash():
    """Prompt P fills pages 0..2 (hashed); crop back into page 2 and write one other token there (the page is not
    full again, so nothing re-hashes it); after reset, P must not reuse page 2 (its slot 10 holds the other token):
    the logits are a fresh cache's."""
    ref, paged = make_pair("llama")
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 96, (1, 13), generator=g)
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    with torch.no_grad():
        paged(input_ids=prompt, cache=cache)  # pages 0..2 full and hashed, page 3 holds token 12
        cache.crop(-3)  # 10 tokens: page 2 is partial again
        paged(input_ids=(prompt[:, 10:11] + 1) % 96, cache=cache)  # another token at position 10
        cache.reset()
        got = paged(input_ids=prompt, logits_to_keep=1, cache=cache).logits[0, -1]
        want = ref(input_ids=prompt).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert cache.stats()["prefix_hits"] == 2  # pages 0 and 1 only


@pytest.mark.parametrize("method,indices", [
    ("reorder_cache", [-1, 0]),
    ("reorder_cache", [0, 2]),
    ("reorder_cache", [0.0, 1.0]),
    ("batch_select_indices", [-2]),
    ("batch_select_indices", [5]),
])
def test_row_indices_outside_the_batch_are_refused(method, indices):
    _, paged = shared_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    paged(**left_padded_batch((5, 3)), cache=cache)
    before = [list(r) for r in cache.layers[0].group.rows]
    with pytest.raises(hf_paged.CacheUsageError, match=f"{method}"):
        getattr(cache, method)(torch.tensor(indices))
    assert cache.layers[0].group.rows == before
    check_pages(cache)


def test_batch_repeat_interleave_needs_a_positive_int():
    _, paged = shared_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    paged(**left_padded_batch((5, 3)), cache=cache)
    for repeats in (0, -1, 1.5):
        with pytest.raises(hf_paged.CacheUsageError, match="repeats must be a positive int"):
            cache.batch_repeat_interleave(repeats)
    assert len(cache.layers[0].group.rows) == 2
