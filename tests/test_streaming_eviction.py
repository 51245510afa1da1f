"""Streaming eviction end to end: a bounded FIFO cache generates exactly what StreamingLLM defines.

The reference is independent of the cache: the live pages of each step follow from the policy's definition
(the first ``sink_pages`` pages and the last ``recent_pages`` live pages are kept; when a new page needs
room, the oldest other page goes), and a DynamicCache forward sees exactly those tokens through its padding
mask (the keys it holds were computed with the same masks, step by step). Any other victim, an evicted sink,
or a causal mask that is off by one on the eviction path changes the logits.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")
GEN = dict(pad_token_id=0, eos_token_id=None, do_sample=False)


def streaming_pages(prompt_len: int, total: int, page_size: int, max_pages: int, sink: int, recent: int):
    """For each decoded position t in [prompt_len, total): the logical pages a one-row FIFO cache holds."""
    live = list(range(math.ceil(prompt_len / page_size)))
    kept = []
    for t in range(prompt_len, total):
        if t % page_size == 0:  # a new page: evict the oldest page that is neither a sink nor recent
            if len(live) == max_pages:
                live.remove(next(p for p in live[:-max(recent, 1)] if p >= sink))
            live.append(t // page_size)
        kept.append(list(live))
    return kept


def streaming_reference(ref, prompt: torch.Tensor, new_tokens: int, page_size: int, max_pages: int, sink: int,
                        recent: int):
    """Greedy tokens and per-step logits of StreamingLLM, computed with DynamicCache and a padding mask."""
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        logits = [ref(input_ids=prompt, cache=cache).logits[:, -1]]
        tokens = [int(logits[-1].argmax())]
        total = prompt.shape[1] + new_tokens - 1
        for t, live in zip(range(prompt.shape[1], total), streaming_pages(prompt.shape[1], total, page_size,
                                                                          max_pages, sink, recent)):
            mask = torch.zeros(1, t + 1, dtype=torch.long)
            for page in live:
                mask[0, page * page_size:(page + 1) * page_size] = 1
            out = ref(input_ids=torch.tensor([[tokens[-1]]]), attention_mask=mask, position_ids=torch.tensor([[t]]),
                      cache=cache)
            logits.append(out.logits[:, -1])
            tokens.append(int(logits[-1].argmax()))
    return torch.cat([prompt, torch.tensor([tokens])], 1), logits


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("sink, recent", [(1, 1), (2, 2)])
def test_fifo_generates_what_streaming_llm_defines(backend, sink, recent):
    ref, paged = shared_pair("llama")
    S, max_pages, new_tokens = 2, 6, 16
    prompt = torch.randint(3, 96, (1, 5), generator=torch.Generator().manual_seed(0))
    want, want_logits = streaming_reference(ref, prompt, new_tokens, S, max_pages, sink, recent)
    cache = hf_paged.PagedCache(page_size=S, max_pages=max_pages, config=paged.config, eviction="fifo",
                                sink_pages=sink, recent_pages=recent, backend=backend)
    got = paged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         **GEN, cache=cache, output_logits=True, return_dict_in_generate=True)
    assert cache.stats()["evictions"] >= 4
    for step, (g, w) in enumerate(zip(got.logits, want_logits)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
    assert torch.equal(got.sequences, want)
    check_pages(cache)


def test_streaming_pages_follow_the_definition():
    """The reference's own bookkeeping, on a case small enough to check by hand: pages of 2 tokens, 4 pages,
    1 sink, 1 recent; prompt of 3 tokens (pages 0, 1)."""
    kept = streaming_pages(3, 12, 2, 4, 1, 1)
    assert kept[0] == [0, 1]  # t=3 still on page 1
    assert kept[1] == [0, 1, 2] and kept[3] == [0, 1, 2, 3]  # t=4, t=6: new pages, room left
    assert kept[5] == [0, 2, 3, 4]  # t=8: page 1 (the oldest that is no sink) goes
    assert kept[7] == [0, 3, 4, 5]  # t=10: then page 2
