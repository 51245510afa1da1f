"""Prefix pages and the model that computed them (issue 11, item 4): hashes are rooted in a fingerprint of the
model, so pages are never reused by another model."""

from __future__ import annotations


def test_prefix_pages_are_never_reused_by_another_model():
    """A cache bound to model A, reset, then used by model B (same shapes, other weights): A itself reuses its
    pages (the control, while they are cached), B gets its own K/V (logits of a fresh DynamicCache run of B)."""
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import make_pair

    _, model_a = make_pair("llama", seed=0)
    ref_b, model_b = make_pair("llama", seed=1)
    hf_paged.PagedCache(model=model_b)  # B is bound to a cache of its own: its prefix hook is installed
    prompt = {"input_ids": torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(3))}
    prompt["attention_mask"] = torch.ones_like(prompt["input_ids"])
    kwargs = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)

    cache = hf_paged.PagedCache(page_size=4, model=model_a)
    model_a.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    cache.reset()  # the control: the model that computed the pages reuses them
    model_a.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    hits = cache.stats()["prefix_hits"]
    assert hits > 0

    cache.reset()  # A's pages are cached: B must not find them
    out_b = model_b.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    assert cache.stats()["prefix_hits"] == hits
    want = ref_b.generate(**prompt, **kwargs, **{hf_paged.CACHE_KWARG: DynamicCache(config=ref_b.config)})
    assert torch.equal(out_b.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(out_b.logits), torch.stack(want.logits), rtol=0, atol=1e-4)


def test_fingerprint_covers_weights_dtype_and_page_size():
    import torch

    import hf_paged
    from tiny_models import make_pair

    _, model = make_pair("llama", seed=0)
    _, other = make_pair("llama", seed=1)
    cache, coarse = hf_paged.PagedCache(page_size=4, model=model), hf_paged.PagedCache(page_size=8, model=model)
    root = cache.fingerprint(model)
    assert root == cache.fingerprint(model)
    assert root != cache.fingerprint(other) and root != coarse.fingerprint(model)
    assert root != cache.fingerprint(model.to(dtype=torch.bfloat16))


def test_fingerprint_covers_dtype_and_config_by_themselves():
    """Weights exactly representable in bfloat16, so the sampled values cannot tell float32 from bfloat16: the
    dtype alone must; and a model of another config with the same weights (another rms_norm_eps: other K/V)."""
    import copy

    import torch
    import transformers

    import hf_paged
    from tiny_models import make_pair

    _, model = make_pair("llama")
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    cache = hf_paged.PagedCache(page_size=4, model=model)
    root = cache.fingerprint(model)
    assert root != cache.fingerprint(copy.deepcopy(model).to(torch.bfloat16))
    config = copy.deepcopy(model.config)
    config.rms_norm_eps = 1e-2
    other = transformers.AutoModelForCausalLM.from_config(config).eval()
    other.load_state_dict(model.state_dict())
    assert root != cache.fingerprint(other)


def test_a_ragged_cache_reused_by_another_model_shares_no_pages():
    """generate_many's prompt hashes are chained from the model's fingerprint: a RaggedCache filled by model A
    gives model B (same shapes, other weights) none of A's pages, and B's tokens are its own; A reuses them."""
    from hf_paged.ragged_cache import RaggedCache
    from test_generate_many import generate_each, random_prompts
    from tiny_models import make_pair

    import hf_paged

    _, model_a = make_pair("llama", seed=0)
    ref_b, model_b = make_pair("llama", seed=1)
    prompts = random_prompts((13, 18), seed=30)
    cache = RaggedCache(model_a.config, page_size=4)
    kwargs = dict(max_new_tokens=5, eos_token_id=[], cache=cache, progress=False)
    hf_paged.generate_many(model_a, prompts, **kwargs)
    hf_paged.generate_many(model_a, prompts, **kwargs)
    hits = cache.prefix_hits
    assert hits == 3 + 4  # the control: A reuses its full prompt pages
    assert hf_paged.generate_many(model_b, prompts, **kwargs) == generate_each(ref_b, prompts, [5, 5], eos_token_id=None)
    assert cache.prefix_hits == hits
