"""A used PagedCache given to a second `generate` without reset() (issue 36, part 5): transformers writes the new
prompt after the cached tokens at the wrong positions and returns other tokens, silently (DynamicCache does too);
the paged cache refuses it, saying "one cache per call, or reset()", and stays usable. A continuation (the whole
conversation so far as input, left padded or not) still works."""

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from tiny_models import left_padded_batch, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def test_a_second_call_without_reset_is_refused_and_the_cache_stays_usable(llama):
    ref, paged = llama
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    first = ref.generate(prompt, max_new_tokens=4, pad_token_id=0)
    cache = hf_paged.PagedCache(config=paged.config)
    assert torch.equal(paged.generate(prompt, max_new_tokens=4, cache=cache, pad_token_id=0), first)
    reused = DynamicCache(config=ref.config)
    ref.generate(prompt, max_new_tokens=4, cache=reused, pad_token_id=0)
    assert not torch.equal(ref.generate(prompt, max_new_tokens=4, cache=reused, pad_token_id=0), first)  # silent
    with pytest.raises(hf_paged.CacheUsageError, match=r"one cache per call, or reset\(\)"):
        paged.generate(prompt, max_new_tokens=4, cache=cache, pad_token_id=0)
    cache.reset()
    assert torch.equal(paged.generate(prompt, max_new_tokens=4, cache=cache, pad_token_id=0), first)


def test_a_continuation_is_not_refused(llama):
    """The whole conversation so far as the next input: the same tokens as a DynamicCache continued alike."""
    ref, paged = llama
    batch = left_padded_batch((9, 5, 13))
    outputs = []
    for model, cache in ((ref, DynamicCache(config=ref.config)), (paged, hf_paged.PagedCache(config=paged.config))):
        first = model.generate(**batch, max_new_tokens=3, cache=cache, pad_token_id=0)
        mask = torch.cat([batch["attention_mask"], torch.ones(3, 3, dtype=torch.long)], dim=1)
        outputs.append(model.generate(input_ids=first, attention_mask=mask, max_new_tokens=3, cache=cache,
                                      pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1])
