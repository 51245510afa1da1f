"""Beam search on a PagedCache: same sequences and scores as DynamicCache, less memory, every page given back.

Beams share their prompt's pages through `reorder_cache`; a shared, partly filled page is copied on write.
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_all_given_back, check_pages
from tiny_models import left_padded_batch, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


BEAMS = [  # (num_beams, num_return_sequences, length_penalty, early_stopping)
    (2, 1, 1.0, False),
    (4, 2, 0.5, True),
    (8, 3, 1.5, "never"),
]


@pytest.mark.parametrize("beams", BEAMS, ids=lambda b: f"beams{b[0]}-ret{b[1]}-lp{b[2]}-es{b[3]}")
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt2"])
def test_beam_search_matches_dynamic_cache_with_less_memory(name, beams):
    ref, paged = shared_pair(name)
    num_beams, num_return, length_penalty, early_stopping = beams
    batch = left_padded_batch((9, 5))
    gen = dict(max_new_tokens=10, pad_token_id=0, do_sample=False, num_beams=num_beams,
               num_return_sequences=num_return, return_dict_in_generate=True, output_scores=True)
    # an end token that the best beam produces at step 4: hypotheses finish at different steps
    probe = ref.generate(**batch, **gen, eos_token_id=None).sequences
    eos = int(probe[0, batch["input_ids"].shape[1] + 3])
    gen.update(eos_token_id=eos, length_penalty=length_penalty, early_stopping=early_stopping)
    dyn = DynamicCache(config=ref.config)
    want = ref.generate(**batch, **gen, cache=dyn)
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    got = paged.generate(**batch, **gen, cache=cache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=1e-5)
    check_pages(cache)
    stats = cache.stats()
    assert stats["kv_bytes"] < dynamic_bytes(dyn), (stats, dynamic_bytes(dyn))
    assert stats["pages_cached"] == 0  # no model bound: nothing is kept for prefix reuse
    managers = [g.manager for g in cache.groups.values()]
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)


def test_dropping_a_finished_beam_search_cache_gives_every_page_back():
    ref, paged = shared_pair("llama")
    cache = hf_paged.PagedCache(page_size=3, config=paged.config)
    out = paged.generate(**left_padded_batch((7, 4)), max_new_tokens=8, num_beams=4, pad_token_id=0,
                         eos_token_id=None, do_sample=False, cache=cache, return_dict_in_generate=True)
    assert out.cache is cache
    manager = cache.groups[None].manager
    assert manager.num_used > 0
    del out, cache
    gc.collect()
    check_all_given_back(manager)

