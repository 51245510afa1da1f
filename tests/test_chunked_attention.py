"""Chunked attention (Llama 4): chunked layers keep their chunk window and match DynamicCache."""

from __future__ import annotations


def _tiny_llama4(seed=0):
    import copy

    import torch
    import transformers

    import hf_paged

    config = transformers.Llama4TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, intermediate_size_mlp=96, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=6, floor_scale=4, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)
    assert config.layer_types.count("chunked_attention") == 6 and config.attn_temperature_tuning
    torch.manual_seed(seed)
    ref = transformers.Llama4ForCausalLM(copy.deepcopy(config)).eval()
    paged_config = copy.deepcopy(config)
    paged_config._attn_implementation = hf_paged.ATTN_IMPLEMENTATION
    paged = transformers.Llama4ForCausalLM(paged_config).eval()
    paged.load_state_dict(ref.state_dict())
    return ref, paged


def test_chunked_attention_layers_keep_their_chunk_window_and_match_dynamic_cache():
    """Llama 4: chunked layers attend within chunks of 6 tokens; their pages older than the window are
    freed, and greedy tokens and logits equal DynamicCache's (NoPE layers' temperature tuning included)."""
    import torch
    from transformers import DynamicCache

    import hf_paged
    from tiny_models import left_padded_batch

    ref, paged = _tiny_llama4()
    batch = left_padded_batch((13, 7))
    kwargs = dict(max_new_tokens=14, do_sample=False, output_logits=True, return_dict_in_generate=True)
    want = ref.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: DynamicCache(config=ref.config)})
    cache = hf_paged.PagedCache(page_size=2, config=paged.config)
    got = paged.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: cache})
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-4)
    chunked, full = cache.groups[6], cache.groups[None]
    assert set(cache.groups) == {6, None}
    assert chunked.tokens_stored() <= 2 * (6 + 2) < full.tokens_stored() == 2 * (13 + 13)
