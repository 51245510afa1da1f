"""Prefix caching after a forward its hook cannot log (issue 30, item 2): ``inputs_embeds`` instead of
``input_ids``, or another model stepping the bound cache mid-sequence. The token log then no longer describes
the cache: the pages after that forward must get no hash (the call itself still works), so that a later prompt
never reuses a page whose keys were computed from other tokens."""

import pytest
import torch

import hf_paged
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def tokens(n, seed):
    return torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def reuse_is_exact(ref, paged, cache, prompt) -> int:
    """After reset: ``prompt`` through the bound cache gives the last logits of a fresh forward; -> pages reused."""
    cache.reset()
    before = cache.stats()["prefix_hits"]
    with torch.no_grad():
        got = paged(input_ids=prompt, logits_to_keep=1, cache=cache).logits[0, -1]
        want = ref(input_ids=prompt).logits[0, -1]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    return cache.stats()["prefix_hits"] - before


def test_a_forward_with_inputs_embeds_stops_the_hashes():
    """13 logged tokens, 4 as embeddings (not logged), 8 logged: the log would place those 8 at positions 13..20,
    where the cache holds the embedded tokens; a prompt of the 13 + the 8 must reuse the first 3 pages only."""
    ref, paged = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    first, embedded, later, tail = tokens(13, 1), tokens(4, 2), tokens(8, 3), tokens(3, 4)
    with torch.no_grad():
        paged(input_ids=first, cache=cache)
        paged(inputs_embeds=paged.get_input_embeddings()(embedded), cache=cache)  # works, unlogged
        paged(input_ids=later, cache=cache)
    assert cache.get_seq_length() == 25
    assert reuse_is_exact(ref, paged, cache, torch.cat([first, later, tail], 1)) == 3
    assert reuse_is_exact(ref, paged, cache, torch.cat([first, later, tail], 1)) == 5  # logged again: 5 full pages


def test_another_model_stepping_the_bound_cache_stops_the_hashes():
    """Model A's bound cache, stepped by model B (same shapes, other weights) mid-sequence, then by A again."""
    ref, paged = make_pair("llama", seed=0)
    _, other = make_pair("llama", seed=1)
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    first, by_other, later, tail = tokens(13, 5), tokens(8, 6), tokens(4, 7), tokens(3, 8)
    with torch.no_grad():
        paged(input_ids=first, cache=cache)
        other(input_ids=by_other, cache=cache)  # B's keys at positions 13..20: A's hook never sees them
        paged(input_ids=later, cache=cache)
    assert reuse_is_exact(ref, paged, cache, torch.cat([first, later, tail], 1)) == 3


def test_generate_from_inputs_embeds_on_a_bound_cache_is_exact_and_hashes_nothing_after():
    ref, paged = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, model=paged)
    prompt = tokens(10, 9)
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=0)
    embeds = paged.get_input_embeddings()(prompt)
    got = paged.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(prompt), cache=cache, **kwargs)
    want = ref.generate(inputs_embeds=ref.get_input_embeddings()(prompt), attention_mask=torch.ones_like(prompt),
                        **kwargs)
    assert torch.equal(got, want)
    assert cache.stats()["pages_cached"] == 0 and not any(g.manager.page_hash for g in cache.groups.values())
    assert reuse_is_exact(ref, paged, cache, torch.cat([got[:, :8], tokens(2, 10)], 1)) == 0
