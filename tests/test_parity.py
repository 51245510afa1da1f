"""The contract: PagedCache + "hf_paged" attention == DynamicCache + stock attention, per architecture."""

import warnings

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from tiny_models import ARCHITECTURES, left_padded_batch, make_pair

ARCHS = sorted(ARCHITECTURES)
GEN = dict(max_new_tokens=12, pad_token_id=0, eos_token_id=None)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request):
    return request.param, *make_pair(request.param)


def _generate(model, cache, batch, **kwargs):
    return model.generate(**batch, **GEN, cache=cache, return_dict_in_generate=True, output_scores=True, **kwargs)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_greedy_left_padded_batch(pair, page_size):
    name, ref, paged = pair
    batch = left_padded_batch((9, 5, 13))
    want = _generate(ref, DynamicCache(config=ref.config), batch, do_sample=False)
    cache = hf_paged.PagedCache(page_size=page_size, config=paged.config)
    got = _generate(paged, cache, batch, do_sample=False)
    torch.testing.assert_close(got.scores[0], want.scores[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got.sequences, want.sequences)
    assert cache.get_seq_length() == batch["input_ids"].shape[1] + GEN["max_new_tokens"] - 1


def test_greedy_unpadded_batch(pair):
    """No padding: transformers skips the mask (None) and attention must apply causality itself."""
    name, ref, paged = pair
    batch = left_padded_batch((8, 8))
    want = _generate(ref, DynamicCache(config=ref.config), batch, do_sample=False)
    got = _generate(paged, hf_paged.PagedCache(page_size=3, config=paged.config), batch, do_sample=False)
    torch.testing.assert_close(got.scores[0], want.scores[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got.sequences, want.sequences)


def test_past_key_values_keyword(pair):
    name, ref, paged = pair
    batch = left_padded_batch((4, 7, 6))
    want = ref.generate(**batch, **GEN, do_sample=False)
    with warnings.catch_warnings():  # newer transformers renamed the keyword to `cache`; both must work
        warnings.simplefilter("ignore", FutureWarning)
        got = paged.generate(**batch, **GEN, do_sample=False, past_key_values=hf_paged.PagedCache(page_size=4))
    assert torch.equal(got, want)


def test_seeded_sampling(pair):
    name, ref, paged = pair
    batch = left_padded_batch((6, 11, 3))
    sample = dict(do_sample=True, temperature=1.3, top_k=20)
    torch.manual_seed(123)
    want = _generate(ref, DynamicCache(config=ref.config), batch, **sample)
    torch.manual_seed(123)
    got = _generate(paged, hf_paged.PagedCache(page_size=5, config=paged.config), batch, **sample)
    assert torch.equal(got.sequences, want.sequences)


def test_second_turn_continues_returned_cache(pair):
    name, ref, paged = pair
    batch = left_padded_batch((8, 4, 10))
    turn2 = torch.randint(3, 96, (3, 5), generator=torch.Generator().manual_seed(7))
    outs = []
    for model, cache in ((ref, DynamicCache(config=ref.config)),
                         (paged, hf_paged.PagedCache(page_size=3, config=paged.config))):
        first = _generate(model, cache, batch, do_sample=False)
        ids = torch.cat([first.sequences, turn2], dim=1)
        mask = torch.cat([batch["attention_mask"], torch.ones(3, ids.shape[1] - batch["input_ids"].shape[1],
                                                              dtype=torch.long)], dim=1)
        second = _generate(model, first.past_key_values, {"input_ids": ids, "attention_mask": mask},
                           do_sample=False)
        outs.append(second)
    torch.testing.assert_close(outs[1].scores[0], outs[0].scores[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(outs[1].sequences, outs[0].sequences)
