"""Prefix reuse end to end: a bound cache filled through realistic generation, then `reset()` and a prompt
that can reuse its pages.

Oracle: the reused run's sequences and per-step logits equal a fresh full forward with DynamicCache, and
``stats()["prefix_hits"]`` counts exactly the pages that can be reused (every row's full pages computed
with their whole context, up to the last page before the prompt's last token), and none elsewhere.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import left_padded_batch, make_config, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96
GREEDY = dict(pad_token_id=0, eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    """(reference, paged) llama; the paged model gets the prefix hook (its caches are bound to it)."""
    return make_pair("llama")


def tokens(*shape, seed=0) -> torch.Tensor:
    return torch.randint(3, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def run_and_compare(pair, cache, input_ids, attention_mask=None, new_tokens=3, others=()) -> int:
    """Greedy generation on ``cache`` equals DynamicCache's (tokens and every step's logits); returns the
    prefix hits it added (``others``: caches sharing the pool, for the page accounting)."""
    ref, paged = pair
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    gen = dict(**GREEDY, max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
    before = cache.stats()["prefix_hits"]
    got = paged.generate(input_ids=input_ids, attention_mask=mask, cache=cache, **gen)
    want = ref.generate(input_ids=input_ids, attention_mask=mask, cache=DynamicCache(config=ref.config), **gen)
    assert torch.equal(got.sequences, want.sequences)
    for step, (g, w) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    check_pages(cache, *others)
    return cache.stats()["prefix_hits"] - before


def reusable(lengths, page_size: int, cached_tokens: int) -> int:
    """Pages a prompt of rows of ``lengths`` tokens reuses when its first ``cached_tokens`` are cached."""
    return len(lengths) * (min(min(lengths) - 1, cached_tokens) // page_size)


# ---------------------------------------------------------------------- generation, then reuse
@pytest.mark.parametrize("page_size", [2, 3])
def test_beam_search_pages_are_reused_with_their_beams_tokens(llama, page_size):
    """reorder_cache moves rows between beams: the hashes must follow the pages (the token log is remapped)."""
    ref, paged = llama
    cache = hf_paged.PagedCache(page_size=page_size, model=paged)
    orders = []
    reorder = cache.reorder_cache
    cache.reorder_cache = lambda beam_idx: (orders.append(beam_idx.tolist()), reorder(beam_idx))[1]
    prompt = tokens(1, 7)
    out = paged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache, num_beams=4,
                         num_return_sequences=4, max_new_tokens=8, **GREEDY)
    want = ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), num_beams=4,
                        num_return_sequences=4, max_new_tokens=8, **GREEDY)
    assert torch.equal(out, want)
    assert any(order != sorted(order) for order in orders), "no beam moved: the test does not exercise reorder"
    cache.reset()
    # every beam's tokens but the last were computed with their whole context
    hits = run_and_compare(llama, cache, out)
    assert hits == reusable([out.shape[1]] * 4, page_size, out.shape[1] - 1)


def test_sampled_sequences_pages_are_reused(llama):
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    batch = dict(input_ids=tokens(2, 6, seed=1), attention_mask=torch.ones(2, 6, dtype=torch.long))
    torch.manual_seed(0)
    out = paged.generate(**batch, cache=cache, do_sample=True, num_return_sequences=3, max_new_tokens=7,
                         pad_token_id=0, eos_token_id=None)
    cache.reset()
    hits = run_and_compare(llama, cache, out)
    assert hits == reusable([out.shape[1]] * 6, S, out.shape[1] - 1)


@pytest.mark.parametrize("method", ["assistant", "prompt_lookup"])
def test_pages_of_a_speculative_run_are_reused_after_its_crops(llama, method):
    """Rejected candidate tokens are cropped from the cache and from the token log."""
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    pattern = tokens(1, 3, seed=2)
    prompt = torch.cat([tokens(1, 4, seed=3), pattern, pattern, pattern], 1)
    if method == "assistant":
        cfg = make_config("llama")
        cfg.num_hidden_layers = 1
        torch.manual_seed(1)
        extra = dict(assistant_model=transformers.AutoModelForCausalLM.from_config(cfg).eval())
    else:
        extra = dict(prompt_lookup_num_tokens=3)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    out = paged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                         max_new_tokens=14, **GREEDY, **extra)
    assert torch.equal(out, ref.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                         max_new_tokens=14, **GREEDY, **extra))
    assert any(n < 0 for n in crops), "no candidate was rejected: the test does not exercise crop"
    computed = cache.get_seq_length()
    cache.reset()
    hits = run_and_compare(llama, cache, out)
    assert hits == reusable([out.shape[1]], S, computed)


def test_fork_pages_are_reused_and_a_fork_made_before_the_first_step_shares_the_pools(llama):
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    early = cache.fork()  # before any step: no pool allocated yet
    prompt = tokens(1, 9, seed=4)
    first = paged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=early,
                           max_new_tokens=4, **GREEDY)
    early.commit()  # hashes the fork's last step (its next step, stats() or reset() would too)
    # the original has no tokens: it reuses the fork's pages, read from the pools they share
    hits = run_and_compare(llama, cache, first, others=[early])
    assert hits == reusable([first.shape[1]], S, first.shape[1] - 1)
    cache.crop(first.shape[1] - cache.get_seq_length())  # back to `first`: a prompt cache, forked per question
    late = cache.fork()
    question = torch.cat([first, tokens(1, 3, seed=5)], 1)
    grown = paged.generate(input_ids=question, attention_mask=torch.ones_like(question), cache=late,
                           max_new_tokens=3, **GREEDY)
    late.reset()  # hashes its last step; a dropped cache's last step stays unhashed (fewer hits, never wrong)
    del early, late
    cache.reset()
    assert run_and_compare(llama, cache, grown) == reusable([grown.shape[1]], S, grown.shape[1] - 1)


def test_left_padded_rows_reuse_only_pages_computed_at_the_same_positions(llama):
    """generate counts a left-padded row's positions from its first real token; a plain forward from the
    first column. Pages of the same tokens at other positions hold other keys (RoPE)."""
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    batch = left_padded_batch((11, 7), seed=6)
    out = paged.generate(**batch, cache=cache, max_new_tokens=4, **GREEDY)
    cache.reset()
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 4, dtype=torch.long)], 1)
    assert run_and_compare(llama, cache, out, mask) == reusable([out.shape[1]] * 2, S, out.shape[1] - 1)
    cache.reset()
    # the padded row alone, through a plain forward (positions from column 0): the same tokens and mask
    # bits, at other positions; and its first pages are only padding, whose mask bits match
    row, row_mask = out[1:], mask[1:]
    before = cache.stats()["prefix_hits"]
    with torch.no_grad():
        got = paged(input_ids=row, attention_mask=row_mask, cache=cache, logits_to_keep=1).logits
        want = ref(input_ids=row, attention_mask=row_mask).logits[:, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert cache.stats()["prefix_hits"] == before


def test_pages_after_another_prefix_or_at_another_position_are_not_reused(llama):
    """Rows [A B C] and [D E F] are cached. [A B ...] reuses A and B (the control); [D B ...] may reuse D only: B
    was computed after A. [B C ...] reuses nothing: B and C were computed at other positions, after A. (The pool
    recycles cached pages before it grows: the control runs first, while A and B are still cached.)"""
    S = 4
    cache = hf_paged.PagedCache(page_size=S, model=llama[1])
    a, b, c, d, e, f = (tokens(1, S, seed=10 + i) for i in range(6))
    batch = torch.cat([torch.cat([a, b, c], 1), torch.cat([d, e, f], 1)])
    assert run_and_compare(llama, cache, batch) == 0
    cache.reset()
    assert run_and_compare(llama, cache, torch.cat([a, b, tokens(1, 2, seed=22)], 1)) == 2
    cache.reset()
    assert run_and_compare(llama, cache, torch.cat([d, b, c, tokens(1, 2, seed=20)], 1)) == 1
    cache.reset()
    assert run_and_compare(llama, cache, torch.cat([b, c, tokens(1, 2, seed=21)], 1)) == 0


def test_pages_computed_after_an_eviction_are_not_reused():
    """A bounded pool evicts mid-generation: later tokens attend fewer, so their pages differ from a full
    forward's and must not be reused, even when all pages before them are cached again."""
    pair = make_pair("llama")
    ref, paged = pair
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged, max_pages=12, eviction="fifo", sink_pages=1,
                                recent_pages=1)
    batch = dict(input_ids=tokens(2, 4, seed=30), attention_mask=torch.ones(2, 4, dtype=torch.long))
    out = paged.generate(**batch, cache=cache, max_new_tokens=20, **GREEDY)
    assert cache.stats()["evictions"] > 0
    exact = min(g.eviction.exact_tokens for g in cache.groups.values())
    cache.reset()
    row = out[1:]
    # recompute row 1's evicted stretch exactly (pool room comes from row 0's cached pages first) ...
    refill = row[:, :exact + 2 * S]
    assert run_and_compare(pair, cache, refill, new_tokens=1) <= reusable([refill.shape[1]], S, exact)
    cache.reset()
    # ... so that every page of row 1 before the ones computed after the eviction is cached again
    assert run_and_compare(pair, cache, row, new_tokens=1) == reusable([row.shape[1]], S, refill.shape[1])


# ------------------------------------------------------------------------ what a forward returns
def test_reuse_keeps_the_logits_the_caller_asked_for(llama):
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    ids = tokens(1, 11, seed=40)
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        paged(input_ids=ids, cache=cache, logits_to_keep=1)
        for keep, n in ((0, 11), (4, 4), (torch.tensor([2, 9]), 2), (1, 1)):
            cache.reset()
            before = cache.stats()["prefix_hits"]
            got = paged(input_ids=ids, cache=cache, logits_to_keep=keep).logits
            assert got.shape[1] == n
            index = torch.arange(11)[-n:] if not torch.is_tensor(keep) else keep
            torch.testing.assert_close(got[0], want[0, index], atol=1e-4, rtol=1e-4)
            first_kept = int(index[0])
            assert cache.stats()["prefix_hits"] - before == min(first_kept, 10) // S


def test_float_padding_masks_hash_like_integer_masks(llama):
    """transformers reads a 2D mask as nonzero = attend; a float mask must name the same pages."""
    ref, paged = llama
    S = 2
    cache = hf_paged.PagedCache(page_size=S, model=paged)
    batch = left_padded_batch((9, 6), seed=41)
    run_and_compare(llama, cache, batch["input_ids"], batch["attention_mask"])
    cache.reset()
    hits = run_and_compare(llama, cache, batch["input_ids"], batch["attention_mask"].float())
    assert hits == reusable([9, 9], S, 8)


def test_a_custom_4d_mask_is_refused_on_a_bound_cache(llama):
    ref, paged = llama
    cache = hf_paged.PagedCache(page_size=2, model=paged)
    ids = tokens(1, 6, seed=42)
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    with pytest.raises(hf_paged.CacheUsageError, match="2D padding mask"), torch.no_grad():
        paged(input_ids=ids, attention_mask=mask, cache=cache)
    assert cache.get_seq_length() == 0 and cache.stats()["pages_used"] == 0
    run_and_compare(llama, cache, ids)  # still usable
