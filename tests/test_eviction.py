"""Bounded pools: eviction order per policy, protected pages, exactness within budget, soak."""

import gc
import logging

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.block_manager import EVICTED
from hf_paged.eviction import EvictionPolicy
from page_checks import check_pages
from tiny_models import left_padded_batch, make_pair

GEN = dict(pad_token_id=0, eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def test_policy_victims_on_synthetic_usage():
    row = [10, 11, 12, 13, 14, 15]
    used = {10: 9, 11: 5, 12: 1, 13: 7, 14: 2, 15: 9}
    assert EvictionPolicy("lru", sink_pages=1, recent_pages=1).victim(row, 0, used) == 2  # page 12, least used
    assert EvictionPolicy("fifo", sink_pages=1, recent_pages=1).victim(row, 0, used) == 1  # oldest after sink
    assert EvictionPolicy("fifo", sink_pages=0, recent_pages=1).victim(row, 0, used) == 0
    assert EvictionPolicy("lru", sink_pages=3, recent_pages=2).victim(row, 0, used) == 3  # 12 is a sink now
    assert EvictionPolicy("lru", sink_pages=1, recent_pages=1).victim([10, EVICTED, 12], 0, used) is None


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_protected_pages_are_never_evicted(llama, eviction):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=5, config=paged.config, eviction=eviction,
                                sink_pages=2, recent_pages=2)
    paged.generate(**left_padded_batch((6,)), max_new_tokens=30, **GEN, cache=cache)
    row = cache.groups[None].rows[0]
    assert cache.stats()["evictions"] > 0
    assert row[0] != EVICTED and row[1] != EVICTED  # sinks
    live = [p for p in row if p != EVICTED]
    assert row[-2:] == live[-2:] and EVICTED not in row[-2:]  # recent window
    assert len(live) == 5
    check_pages(cache)


def test_lru_evicts_the_page_attention_ignores():
    """Synthetic attention: the usage signal decides the victim (not the age, as fifo would)."""
    cache = hf_paged.PagedCache(page_size=1, max_pages=4, eviction="lru", sink_pages=0, recent_pages=1)
    k = torch.zeros(1, 1, 4, 2)
    cache.update(k, k, 0)
    group = cache.groups[None]
    # tokens 0..3 on pages of the row; the step's attention went to pages of tokens 0 and 2 only
    group.step.add_usage(torch.tensor([[0.5, 0.0, 0.5, 0.0]]))
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # one more token: the pool is full, one page goes
    row = group.rows[0]
    assert row[1] == EVICTED and row.count(EVICTED) == 1, row
    fifo = hf_paged.PagedCache(page_size=1, max_pages=4, eviction="fifo", sink_pages=0, recent_pages=1)
    fifo.update(k, k, 0)
    fifo.update(k[:, :, :1], k[:, :, :1], 0)
    assert fifo.groups[None].rows[0][0] == EVICTED


@pytest.mark.parametrize("eviction", ["lru", "fifo"])
def test_budget_covering_the_sequence_equals_unbounded(llama, eviction):
    ref, paged = llama
    batch = left_padded_batch((9, 5, 12))
    want = ref.generate(**batch, max_new_tokens=10, **GEN, cache=DynamicCache(config=ref.config),
                        return_dict_in_generate=True, output_scores=True)
    cache = hf_paged.PagedCache(page_size=4, max_pages=3 * 6, config=paged.config, eviction=eviction)
    got = paged.generate(**batch, max_new_tokens=10, **GEN, cache=cache, return_dict_in_generate=True,
                         output_scores=True)
    assert cache.stats()["evictions"] == 0
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_eviction_changes_output_and_logs_once(llama, caplog):
    _, paged = llama
    batch = left_padded_batch((6,))
    full = paged.generate(**batch, max_new_tokens=16, **GEN, cache=hf_paged.PagedCache(page_size=2))
    with caplog.at_level(logging.WARNING):
        bounded = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
        got = paged.generate(**batch, max_new_tokens=16, **GEN, cache=bounded)
    assert bounded.stats()["evictions"] > 0 and bounded.stats()["pages_used"] <= 4
    assert bounded.get_seq_length() == 6 + 15  # tokens processed, not stored
    assert got.shape == full.shape
    assert caplog.text.count("evicting pages") <= 1


def test_eviction_with_batch_and_beams_keeps_reference_counts(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=14, config=paged.config, eviction="lru")
    paged.generate(**left_padded_batch((10, 7)), max_new_tokens=12, num_beams=3, **GEN, cache=cache)
    assert cache.stats()["evictions"] > 0
    check_pages(cache)
    cache.reset()
    check_pages(cache)
    assert cache.stats()["pages_used"] == 0


def test_prompt_larger_than_the_budget_says_to_chunk(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
    with pytest.raises(hf_paged.PagePoolExhausted, match="in chunks"):
        paged.generate(**left_padded_batch((20,)), max_new_tokens=2, **GEN, cache=cache)
    check_pages(cache)


def test_evicted_cache_refuses_other_attention(llama):
    ref, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
    paged.generate(**left_padded_batch((6,)), max_new_tokens=6, **GEN, cache=cache)
    assert cache.stats()["evictions"] > 0
    with pytest.raises(hf_paged.CacheUsageError, match="only the 'hf_paged' attention"):
        ref(input_ids=torch.tensor([[5]]), cache=cache)


@pytest.mark.parametrize("bad", [dict(eviction="random"), dict(sink_pages=-1), dict(recent_pages=1.5),
                                 dict(lru_threshold=2.0)])
def test_bad_eviction_arguments(bad):
    with pytest.raises(hf_paged.CacheUsageError):
        hf_paged.PagedCache(max_pages=8, **bad)


def test_soak_bounded_cache_with_forks_and_resets(llama):
    """Hundreds of generate calls on one bounded cache: page accounting returns to its baseline."""
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=12, config=paged.config, eviction="fifo")
    g = torch.Generator().manual_seed(0)
    baseline = None
    for i in range(200):
        cache.reset()
        prompt = torch.randint(3, 96, (1, int(torch.randint(2, 12, (1,), generator=g))), generator=g)
        paged.generate(input_ids=prompt, max_new_tokens=int(torch.randint(1, 8, (1,), generator=g)), **GEN,
                       cache=cache)
        if i % 3 == 0:
            fork = cache.fork()
            paged(input_ids=torch.tensor([[7]]), cache=fork)
            del fork
        check_pages(cache)
        if i == 100:
            gc.collect()
            baseline = cache.stats()["pages_total"], cache.stats()["pool_bytes"]
    cache.reset()
    gc.collect()
    stats = cache.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    assert (stats["pages_total"], stats["pool_bytes"]) == baseline  # memory stopped growing
    assert stats["pages_total"] <= 12  # and stays within the bound
