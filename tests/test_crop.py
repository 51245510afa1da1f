"""crop(): assisted decoding and prompt lookup release rejected pages; crops that would need tokens a
sliding window already freed are refused, changing nothing (in any layer group)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import hybrid_cache_config, make_config, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 96


_ASSISTANTS: dict[str, torch.nn.Module] = {}


def assistant(name: str):
    if name not in _ASSISTANTS:
        cfg = make_config(name)
        cfg.num_hidden_layers = 1
        torch.manual_seed(1)
        _ASSISTANTS[name] = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return _ASSISTANTS[name]


@pytest.mark.parametrize("method", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_speculative_decoding_crops_and_releases_rejected_pages(name, method):
    ref, paged = shared_pair(name)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, VOCAB, (1, 4), generator=g)
    ids = torch.cat([torch.randint(3, VOCAB, (1, 5), generator=g), pattern, pattern, pattern], 1)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    extra = dict(assistant_model=assistant(name)) if method == "assistant" else dict(prompt_lookup_num_tokens=3)
    gen = dict(max_new_tokens=20, pad_token_id=0, eos_token_id=None, do_sample=False, **extra)
    dyn = DynamicCache(config=ref.config)
    want = ref.generate(**inputs, **gen, cache=dyn)
    S = 4
    cache = hf_paged.PagedCache(page_size=S, config=paged.config)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    got = paged.generate(**inputs, **gen, cache=cache)
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops), "no candidate token was rejected: the test does not exercise crop"
    stored = cache.get_seq_length()
    assert stored == dyn.get_seq_length() == got.shape[1] - 1
    for window, group in cache.groups.items():
        first = 0 if window is None else max(0, stored - window + 1) // S
        assert all(len(r) == math.ceil(stored / S) - first for r in group.rows), (window, group.rows)
        assert group.manager.num_used == len(group.rows) * (math.ceil(stored / S) - first)
    check_pages(cache)



def test_crop_past_the_window_is_refused():
    """19 tokens, window 4, page size 2: pages before position 14 are freed; crop(-4) leaves 15 tokens, but the
    next query (position 15) attends positions 12..15, and 12, 13 are gone: the crop must be refused."""
    cache = hf_paged.PagedCache(page_size=2, config=hybrid_cache_config(4, ("sliding_attention",)))
    cache.update(torch.ones(1, 1, 18, 2), torch.ones(1, 1, 18, 2), 0)
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    with pytest.raises(hf_paged.CacheUsageError, match="cannot crop"):
        cache.crop(-4)
    assert cache.get_seq_length() == 19


def test_a_crop_refused_by_one_group_crops_no_group():
    """A [full, sliding] cache: a crop that the sliding group refuses must not crop the full group."""
    cache = hf_paged.PagedCache(page_size=2, config=hybrid_cache_config(3, ("full_attention", "sliding_attention")))
    for n in (8, 1):
        for layer in range(2):
            cache.update(torch.ones(1, 1, n, 2), torch.ones(1, 1, n, 2), layer)
    with pytest.raises(hf_paged.CacheUsageError, match="cannot crop"):
        cache.crop(-8)
    assert cache.get_seq_length() == 9
    assert [g.num_tokens for g in cache.groups.values()] == [9, 9]


def test_crop_that_loses_part_of_the_window_is_refused_or_exact():
    ref, paged = shared_pair("mistral")  # sliding window 7
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    with torch.no_grad():
        paged(input_ids=ids[:, :18], cache=cache)
        paged(input_ids=ids[:, 18:19], cache=cache)  # pages before position 12 are freed
    try:
        cache.crop(-6)  # 13 tokens left: position 13 attends 7..13
    except hf_paged.CacheUsageError:
        assert cache.get_seq_length() == 19  # refused, as DynamicCache refuses (it raises RuntimeError)
        return
    with torch.no_grad():
        got = paged(input_ids=ids[:, 13:14], cache=cache).logits[0, -1]
        want = ref(input_ids=ids[:, :14]).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
