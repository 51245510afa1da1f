"""`RaggedCache` steps at the page level (issue 30, planted bugs): `abort_step` gives a copied-from page its
reference back, a write that fills a shared partial page copies it first, and a plan the cache cannot take is
refused before anything changes."""

import dataclasses
from collections import Counter

import pytest
import torch

import hf_paged
from hf_paged.attention import PagedKV, paged_attention_forward
from hf_paged.ragged_cache import RaggedCache
from tiny_models import make_config


def references_match(cache: RaggedCache) -> None:
    """Every page's count is the number of sequences that hold it; the manager's invariants hold."""
    held = Counter(p for seq in cache.sequences.values() for p in seq.pages)
    assert {p: cache.manager.ref[p] for p in range(cache.manager.num_pages) if cache.manager.ref[p]} == dict(held)
    cache.manager.check_invariants()


def forked(length: int, page_size: int = 4) -> RaggedCache:
    """Sequence 0 holds ``length`` tokens (written by a step), sequence 1 is its fork (all pages shared)."""
    cache = RaggedCache(make_config("llama"), page_size=page_size)
    cache.add_sequence(0)
    cache.begin_step([(0, length)])
    cache.finish_step()
    cache.fork_sequence(0, 1)
    return cache


@pytest.mark.parametrize("length", [6, 3, 8])
def test_abort_step_gives_every_page_its_references_back(length):
    cache = forked(length)
    before = {s: (list(seq.pages), seq.length) for s, seq in cache.sequences.items()}
    cache.begin_step([(0, 1), (1, 1)])  # a partial page: sequence 0 copies it, sequence 1 then writes in place
    cache.abort_step()
    assert {s: (seq.pages, seq.length) for s, seq in cache.sequences.items()} == before
    references_match(cache)
    cache.release_sequence(0)
    cache.release_sequence(1)
    assert cache.manager.num_used == 0


@pytest.mark.parametrize("length,new", [(3, 1), (2, 2), (7, 1), (6, 5)])
def test_a_write_into_a_shared_partial_page_copies_it_even_when_it_fills_it(length, new):
    cache = forked(length)
    step = cache.begin_step([(0, new), (1, new)])
    assert step.copy_src is not None and step.copy_src.tolist() == [cache.sequences[1].pages[length // 4]]
    assert set(step.slots[:new].tolist()).isdisjoint(step.slots[new:].tolist())  # no slot written by both
    cache.finish_step()
    assert cache.sequences[0].pages[length // 4] != cache.sequences[1].pages[length // 4]
    references_match(cache)


@pytest.mark.parametrize("plan", [[(0, 2), (1, 1)], [(0, 1), (0, 1)], [(0, 0)], [(7, 1)]])
def test_a_plan_the_cache_cannot_take_changes_nothing(plan):
    cache = forked(6)
    before = ({s: (list(seq.pages), seq.length) for s, seq in cache.sequences.items()}, list(cache.manager.ref),
              cache.manager.num_pages)
    with pytest.raises(hf_paged.CacheUsageError, match="one-token segments first"):
        cache.begin_step(plan)
    assert ({s: (list(seq.pages), seq.length) for s, seq in cache.sequences.items()}, list(cache.manager.ref),
            cache.manager.num_pages) == before
    assert cache.step is None
    cache.begin_step([(0, 1), (1, 2)])  # still usable
    cache.finish_step()
    references_match(cache)


@pytest.mark.parametrize("kv_format", ["float", "int8"])
def test_a_fresh_prompt_attends_over_what_its_pages_hold(kv_format):
    """A segment with no past reads the step's own keys and values only where the pages hold them bit for bit
    (float pages): the output equals reading the pages back; quantized pages are always read back."""
    cache = RaggedCache(make_config("llama"), page_size=4, kv_format=kv_format)
    for seq_id in (0, 1, 2):
        cache.add_sequence(seq_id)
    cache.begin_step([(2, 5)])
    layer = cache.layers[0]
    layer.update(torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16))
    cache.begin_step([(2, 1), (0, 6), (1, 9)])  # a decode row, then two fresh prompts
    torch.manual_seed(0)
    keys, values, query = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16), torch.randn(1, 4, 16, 16)
    paged_keys, paged_values = layer.update(keys, values)
    view = paged_keys.paged
    assert (view.step_kv is not None) == (kv_format == "float")
    read_back = dataclasses.replace(view, step_kv=None)
    out = paged_attention_forward(None, query, paged_keys, paged_values, None, 0.25)[0]
    expected = paged_attention_forward(None, query, PagedKV(read_back, "k", paged_keys.shape),
                                       PagedKV(read_back, "v", paged_values.shape), None, 0.25)[0]
    assert torch.equal(out, expected)
