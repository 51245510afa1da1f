"""The scheduler's page reservations (issue 30, item 1 and the planted reservation bugs): a bounded
`generate_many` never runs out of pages mid-run, ``reserved`` equals the running rows' reserves after
every step and is 0 at the end, and a prompt that fits the pool exactly is admitted."""

import pytest

import hf_paged
from batching_checks import checked_scheduling, sampled_alone
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def group_pages(prompt_len: int, new: int, rows: int, page_size: int) -> int:
    """Pages a prompt's ``rows`` rows may take: the leader's pages, then each fork's own (its partial page copied)."""
    last = -(-(prompt_len + new) // page_size)
    return last + (rows - 1) * (last - prompt_len // page_size)


def test_a_repeated_prompt_sharing_a_partial_page_never_exhausts_the_pool(llama):
    """The issue's reproduction: two rows share the partial page of prompt a; only the first writer copies it, so
    the step must charge one copy, not two (else admission lets prompt b in and the pool runs dry)."""
    ref, paged = llama
    a, b = random_prompts((10, 5), seed=11)
    prompts = [a, b, a]
    want = generate_each(ref, prompts, [8] * 3, eos_token_id=None)
    with checked_scheduling():
        got = hf_paged.generate_many(paged, prompts, max_new_tokens=8, page_size=8, max_pages=6, eos_token_id=[],
                                     progress=False)
    assert got == want


SCENARIOS = {  # name -> (prompt lengths, max_new_tokens, num_return_sequences, repeat prompt 0 at the end, stop)
    "samples": ((10, 7, 13), (6, 9, 4), 3, False, False),
    "duplicate prompts": ((10, 5, 19), (8, 3, 6), 1, True, False),
    "samples of duplicates": ((6, 11), (7, 5), 2, True, False),
    "early stop tokens": ((10, 5, 19, 9), (12, 12, 12, 12), 1, True, True),
}


@pytest.mark.parametrize("page_size", [3, 4])
@pytest.mark.parametrize("pool", ["tight", "roomy"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_reserved_equals_the_rows_reserves_after_every_step(llama, name, pool, page_size):
    """Every step: ``reserved`` is the sum of the running rows' reserves, each covers what its row may still
    allocate (its followers' and copies included), the pool can provide it; 0 when the last row leaves. A
    tight pool holds the largest prompt's rows exactly: admission must wait, never run dry, never refuse them."""
    ref, paged = llama
    lengths, news, samples, repeat, stop = SCENARIOS[name]
    prompts = random_prompts(lengths, seed=len(name))
    news = list(news)
    if repeat:
        prompts, news = prompts + [prompts[0]], news + [news[0] + 2]
    kwargs = dict(max_new_tokens=news, page_size=page_size)
    if samples > 1:
        kwargs.update(do_sample=True, num_return_sequences=samples, seed=5, temperature=1.3)
        want = sampled_alone(paged, prompts, news, samples, 5, temperature=1.3, page_size=page_size, eos_token_id=[])
    else:
        want = generate_each(ref, prompts, news, eos_token_id=None)
    eos = []
    if stop:  # tokens the rows produce early: they leave before their max_new_tokens
        eos = [want[0][2], want[1][0]]
        want = [next((w[:i + 1] for i, t in enumerate(w) if t in eos), w) for w in want]
    tight = max(group_pages(len(p), n, samples * prompts.count(p), page_size) for p, n in zip(prompts, news))
    cache = RaggedCache(paged.config, page_size=page_size, max_pages=tight if pool == "tight" else 4 * tight)
    with checked_scheduling() as schedulers:
        got = hf_paged.generate_many(paged, prompts, eos_token_id=eos, cache=cache, progress=False, **kwargs)
    assert got == want
    assert len(schedulers) == 1 and schedulers[0].reserved == 0 and schedulers[0].done
    assert cache.sequences == {} and cache.manager.num_used == 0
    cache.manager.check_invariants()


@pytest.mark.parametrize("samples", [1, 3])
def test_a_prompt_that_fits_the_pool_exactly_is_admitted(llama, samples):
    """Prompt and new tokens (and its samples' own pages) fill max_pages to the page: it runs; one page less is
    refused before any work, saying what to change."""
    ref, paged = llama
    prompt = random_prompts((10,), seed=2)[0]
    exact = group_pages(10, 6, samples, 4)
    kwargs = dict(max_new_tokens=6, page_size=4, eos_token_id=[], progress=False, num_return_sequences=samples)
    if samples > 1:
        kwargs.update(do_sample=True, seed=1)
    with checked_scheduling():
        got = hf_paged.generate_many(paged, [prompt], max_pages=exact, **kwargs)
    assert got == (generate_each(ref, [prompt], [6], eos_token_id=None) if samples == 1 else
                   hf_paged.generate_many(paged, [prompt], **kwargs))
    with pytest.raises(hf_paged.CacheUsageError, match=f"max_pages={exact - 1}: raise max_pages"):
        hf_paged.generate_many(paged, [prompt], max_pages=exact - 1, **kwargs)


def test_a_reserved_pool_never_raises_mid_step(llama):
    """Many prompts through a pool of two prompts' pages: every step's `begin_step` finds its pages (the step
    charges the copies `begin_step` makes, not one per sharing row)."""
    ref, paged = llama
    prompts = random_prompts((9, 9, 14, 6, 9), seed=3)
    prompts[1] = prompts[0]
    want = generate_each(ref, prompts, [7] * 5, eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=4, max_pages=2 * group_pages(14, 7, 1, 4))
    real = cache.begin_step
    steps = []
    cache.begin_step = lambda new_tokens: steps.append(len(new_tokens)) or real(new_tokens)
    with checked_scheduling():
        assert hf_paged.generate_many(paged, prompts, max_new_tokens=7, eos_token_id=[], cache=cache,
                                      progress=False) == want
    assert max(steps) >= 2  # rows of several prompts shared steps
