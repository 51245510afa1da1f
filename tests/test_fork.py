"""fork() / copy.deepcopy: the copies share every page and continue independently (copy-on-write)."""

from __future__ import annotations

import copy
import gc
import math

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_all_given_back, check_pages, held, ref_counts, row_pages
from tiny_models import left_padded_batch, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


def _extend(batch, question):
    return dict(input_ids=torch.cat([batch["input_ids"], question], 1),
                attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(question)], 1))


@pytest.mark.parametrize("how", ["fork", "deepcopy"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_fork_shares_the_prompt_and_continues_independently(name, how):
    ref, paged = shared_pair(name)
    batch = left_padded_batch((11, 6))
    g = torch.Generator().manual_seed(3)
    questions = [torch.randint(3, VOCAB, (2, n), generator=g) for n in (5, 3)]
    gen = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, do_sample=False)
    split = (lambda c: c.fork()) if how == "fork" else copy.deepcopy

    # the transformers docs pattern: one prompt cache, deep-copied per question
    prompt_cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(**batch, cache=prompt_cache)
    want = [ref.generate(**_extend(batch, q), **gen, cache=copy.deepcopy(prompt_cache)) for q in questions]
    assert not torch.equal(want[0][:, -6:], want[1][:, -6:])

    S = 4
    cache = hf_paged.PagedCache(page_size=S, config=paged.config)
    with torch.no_grad():
        paged(**batch, cache=cache)
    before, refs_before, rows_before = held(cache), ref_counts(cache), row_pages(cache)

    fork = split(cache)
    assert isinstance(fork, hf_paged.PagedCache) and fork is not cache
    assert cache.stats()["pages_used"] == fork.stats()["pages_used"] == before["pages_used"]  # no K/V copied
    assert held(cache) == before and ref_counts(cache) != refs_before  # shared: one more reference each
    assert fork.get_seq_length() == cache.get_seq_length() == batch["input_ids"].shape[1]
    check_pages(cache, fork)

    got = paged.generate(**_extend(batch, questions[0]), **gen, cache=fork)
    assert torch.equal(got, want[0])
    new_tokens = questions[0].shape[1] + gen["max_new_tokens"] - 1
    growth = cache.stats()["pages_used"] - before["pages_used"]
    assert 0 < growth <= len(cache.groups) * 2 * (1 + math.ceil(new_tokens / S))  # only what differs
    assert row_pages(cache) == rows_before
    check_pages(cache, fork)

    del fork, got
    gc.collect()
    assert held(cache) == before and ref_counts(cache) == refs_before

    # the original continues while a fork holds its pages; then the fork continues, unaffected
    fork = split(cache)
    got = paged.generate(**_extend(batch, questions[1]), **gen, cache=cache)
    assert torch.equal(got, want[1])
    check_pages(cache, fork)
    got = paged.generate(**_extend(batch, questions[0]), **gen, cache=fork)
    assert torch.equal(got, want[0])
    check_pages(cache, fork)

    managers = [g.manager for g in cache.groups.values()]
    del fork, got
    gc.collect()
    check_pages(cache)
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)

