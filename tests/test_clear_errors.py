"""Misuse of a `PagedCache` gets a clear error (issue 11, item 6): encoder-decoder models, pickling, bad
arguments, a model of other shapes after reset."""

from __future__ import annotations

import pytest


def _tiny_seq2seq(name):
    import transformers

    if name == "t5":
        config = transformers.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                       decoder_start_token_id=0)
    else:
        config = transformers.BartConfig(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, max_position_embeddings=64)
    return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()


@pytest.mark.parametrize("name", ["t5", "bart"])
@pytest.mark.parametrize("bound", [False, True])
def test_encoder_decoder_models_are_refused_clearly(name, bound):
    import torch

    import hf_paged

    model = _tiny_seq2seq(name)
    with pytest.raises(hf_paged.CacheUsageError, match="decoder-only"):
        cache = hf_paged.PagedCache(config=model.config) if bound else hf_paged.PagedCache()
        model.generate(input_ids=torch.randint(3, 96, (1, 7)), max_new_tokens=3, **{hf_paged.CACHE_KWARG: cache})


def test_pickling_a_cache_says_what_works(tmp_path):
    import copy
    import pickle

    import torch

    import hf_paged
    from tiny_models import make_pair

    _, model = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=4, config=model.config)
    model(input_ids=torch.randint(3, 96, (1, 9)), **{hf_paged.CACHE_KWARG: cache})
    for save in (pickle.dumps, lambda c: torch.save(c, tmp_path / "cache.pt")):
        with pytest.raises(TypeError, match=r"fork\(\).*deepcopy"):
            save(cache)
    assert copy.deepcopy(cache).get_seq_length() == 9 == cache.get_seq_length()


@pytest.mark.parametrize("kwargs,match", [
    (dict(lru_threshold="0.5"), "lru_threshold must be a number"),
    (dict(lru_threshold=None), "lru_threshold must be a number"),
    (dict(config="str"), "config must be a transformers model config"),
    (dict(model=42), "model must be a transformers model"),
    (dict(page_size=10**9), "page_size must be a positive int of at most 65536"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, match):
    import hf_paged

    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.PagedCache(**kwargs)


def test_a_model_of_other_shapes_after_reset_is_told_about_bind_config():
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import make_pair

    _, llama = make_pair("llama")  # 2 KV heads
    ref, neox = make_pair("gpt_neox")  # 4 KV heads
    prompt = torch.randint(3, 96, (1, 9))
    cache = hf_paged.PagedCache(page_size=4, config=llama.config)
    llama.generate(input_ids=prompt, max_new_tokens=2, **{hf_paged.CACHE_KWARG: cache})
    cache.reset()
    with pytest.raises(hf_paged.CacheUsageError, match=r"holds no tokens: call cache.bind_config\(model.config\)"):
        neox.generate(input_ids=prompt, max_new_tokens=2, **{hf_paged.CACHE_KWARG: cache})
    cache.bind_config(neox.config)
    got = neox.generate(input_ids=prompt, max_new_tokens=5, do_sample=False, **{hf_paged.CACHE_KWARG: cache})
    want = ref.generate(input_ids=prompt, max_new_tokens=5, do_sample=False,
                        **{hf_paged.CACHE_KWARG: DynamicCache(config=ref.config)})
    assert torch.equal(got, want)
