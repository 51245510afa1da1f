"""Parity on the real embedded SmolLM2-135M (30 layers, GQA 9/3) with real text."""

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.assets import britannica_prompts, load_model_and_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model_and_tokenizer("smollm2")


def test_smollm2_greedy_batch_matches_dynamic_cache(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer(britannica_prompts(3, min_words=10, max_words=60), return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any(), "prompts of different lengths are left padded"
    gen = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    model.set_attn_implementation("sdpa")
    want = model.generate(**inputs, **gen, cache=DynamicCache(config=model.config))
    model.set_attn_implementation(hf_paged.ATTN_IMPLEMENTATION)
    cache = hf_paged.PagedCache(page_size=16, config=model.config)
    got = model.generate(**inputs, **gen, cache=cache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.scores[0], want.scores[0], atol=1e-4, rtol=1e-4)
    stats = cache.stats()
    assert stats["tokens_stored"] == 3 * (inputs["input_ids"].shape[1] + 11)
