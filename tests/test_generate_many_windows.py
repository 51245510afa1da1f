"""Sliding windows in `generate_many`: a window's layer group frees the pages that leave it, so the pages in use
stay bounded on Mistral- and Gemma-2-style models, with the tokens of per-prompt `model.generate` (DynamicCache)."""

from __future__ import annotations

import math

import pytest
import torch

import hf_paged
from hf_paged.block_manager import EVICTED
from hf_paged.prefix_index import model_fingerprint, page_hashes
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


class PagesPerStep:
    """Before every forward of ``model`` on ``cache``: the pages each layer group holds, by window."""

    def __init__(self, model, cache: RaggedCache):
        self.cache, self.held = cache, []
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.held.append({g.sliding_window: g.manager.num_used for g in self.cache.groups})

    def most(self, window) -> int:
        return max(step[window] for step in self.held)


@pytest.mark.parametrize("name,window", [("mistral", 7), ("gemma2", 6)])
def test_a_window_group_holds_a_bounded_number_of_pages(name, window):
    """Two long generations, one token a step after the prompt: the window's group holds at most the pages of its
    window per sequence (plus the page being written and one it leaves this step); the tokens are DynamicCache's."""
    ref, paged = make_pair(name)
    prompts, new, S = random_prompts((30, 11), seed=5), 60, 2
    cache = RaggedCache(paged.config, page_size=S)
    steps = PagesPerStep(paged, cache)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=new, eos_token_id=[], cache=cache,
                                 max_batch_tokens=8, progress=False)
    assert got == generate_each(ref, prompts, [new] * 2, eos_token_id=None)
    windows = {g.sliding_window for g in cache.groups}
    assert window in windows and windows == ({window} if name == "mistral" else {window, None})
    per_sequence = math.ceil((window - 1) / S) + 1 + 1 + math.ceil(8 / S)  # window, a partial page, a chunk
    assert steps.most(window) <= 2 * per_sequence < math.ceil((30 + new) / S)
    if None in windows:  # Gemma 2's full-attention layers keep every token
        assert steps.most(None) >= math.ceil((30 + new - 1) / S)
    assert cache.manager.num_used == 0 and all(g.manager.num_used == 0 for g in cache.groups)


@pytest.mark.parametrize("max_pages", [None, 40])
def test_the_pool_stays_smaller_than_one_sequence(max_pages):
    """Mistral (every layer slides): pages that leave the window are reused (cached ones too) before the pool
    grows, so an unbounded pool stays far smaller than the sequence; a bounded one (the scheduler reserves every
    token's page, so it must hold the whole sequence) serves it too. The tokens are DynamicCache's."""
    ref, paged = make_pair("mistral")
    prompt, new, S = random_prompts((9,), seed=6)[0], 50, 2
    cache = RaggedCache(paged.config, page_size=S, max_pages=max_pages)
    got = hf_paged.generate_many(paged, [prompt], max_new_tokens=new, eos_token_id=[], cache=cache, progress=False)
    assert got == generate_each(ref, [prompt], [new], eos_token_id=None)
    assert cache.manager.num_pages <= (math.ceil((9 + new) / S) // 2 if max_pages is None else max_pages)
    cache.manager.check_invariants()


def test_samples_and_shared_prefixes_follow_each_group():
    """Gemma 2 with samples (forks share both groups' pages, copied on write) and a system prompt shared across
    prompts and calls: each output equals its prompt run alone, and later calls reuse the prefix in both groups."""
    _, paged = make_pair("gemma2")
    system = random_prompts((16,), seed=7)[0]
    prompts = [system + p for p in random_prompts((3, 5), seed=8)]
    kwargs = dict(max_new_tokens=9, do_sample=True, num_return_sequences=2, eos_token_id=[], page_size=4,
                  progress=False)
    cache = RaggedCache(paged.config, page_size=4)
    first = hf_paged.generate_many(paged, prompts, seed=11, cache=cache, **kwargs)
    alone = [s for i, p in enumerate(prompts) for s in hf_paged.generate_many(paged, [p], seed=11 + 2 * i, **kwargs)]
    assert first == alone
    hits = cache.prefix_hits
    assert hits > 0  # the second prompt shares the system prompt's pages
    assert hf_paged.generate_many(paged, prompts, seed=11, cache=cache, **kwargs) == first
    assert cache.prefix_hits > hits
    for group in cache.groups:
        group.manager.check_invariants()
        assert group.manager.num_used == 0


def test_a_prefix_whose_window_pages_were_recycled_is_recomputed():
    """The full group still caches a prompt's pages but the window's group recycled them: the prompt is computed
    again (sharing only what every group holds), and the tokens stay right."""
    ref, paged = make_pair("gemma2")
    prompt = random_prompts((21,), seed=9)[0]
    cache = RaggedCache(paged.config, page_size=4)
    want = generate_each(ref, [prompt], [5], eos_token_id=None)
    assert hf_paged.generate_many(paged, [prompt], max_new_tokens=5, eos_token_id=[], cache=cache,
                                  progress=False) == want
    sliding = next(g for g in cache.groups if g.sliding_window is not None)
    for page in list(sliding.manager.page_hash):  # as if other prompts had taken the window's cached pages
        sliding.manager.forget(page)
    root = model_fingerprint(paged, 4, [layer.sliding_window for layer in cache.layers])
    hashes = page_hashes(prompt, [1] * len(prompt), list(range(len(prompt))), 4, 0, root)
    assert len(cache.prefix.cached_run(hashes)) == 5 and cache.cached_prefix(hashes, 5) == []
    assert hf_paged.generate_many(paged, [prompt], max_new_tokens=5, eos_token_id=[], cache=cache,
                                  progress=False) == want


def test_steps_trim_and_roll_back_each_group():
    """Pages leaving a window are released when the step is final, and a failed step gives them back."""
    config = make_pair("mistral")[1].config
    cache = RaggedCache(config, page_size=2)
    cache.add_sequence(0)
    cache.begin_step([(0, 12)])
    cache.finish_step()
    group = cache.groups[0]
    held = {p: r for p, r in enumerate(group.manager.ref) if r}
    cache.begin_step([(0, 1)])  # 12 tokens, window 7: tokens 0..5 are no longer read, pages 0..2 leave
    assert cache.sequences[0].pages[:3] == [EVICTED] * 3
    cache.abort_step()
    assert {p: r for p, r in enumerate(group.manager.ref) if r} == held and EVICTED not in cache.sequences[0].pages
    cache.begin_step([(0, 1)])
    cache.finish_step()
    assert group.manager.num_used == 7 - 3
    group.manager.check_invariants()
