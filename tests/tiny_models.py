"""Small random-weight decoder models, one per architecture, for parity tests against DynamicCache."""

from __future__ import annotations

import copy
import functools

import torch
import transformers

import hf_paged

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GQA = dict(num_key_value_heads=2)

# name -> (config class, config kwargs, reference attention implementation)
ARCHITECTURES = {
    "llama": ("LlamaConfig", {**GQA}, "sdpa"),
    "mistral": ("MistralConfig", {**GQA, "sliding_window": 7}, "sdpa"),
    "qwen2": ("Qwen2Config", {**GQA}, "sdpa"),
    "qwen3": ("Qwen3Config", {**GQA, "head_dim": 16}, "sdpa"),
    "gemma2": ("Gemma2Config", {**GQA, "head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 5.0,
                                "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16}, "eager"),
    "gemma3": ("Gemma3TextConfig", {**GQA, "head_dim": 16, "sliding_window": 5, "num_hidden_layers": 4,
                                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                                                    "sliding_attention"], "query_pre_attn_scalar": 16}, "sdpa"),
    "phi3": ("Phi3Config", {**GQA}, "sdpa"),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_layer": 3, "n_head": 4, "n_positions": 512}, "sdpa"),
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.5}, "sdpa"),
    "falcon": ("FalconConfig", {"new_decoder_architecture": True, "num_kv_heads": 2}, "sdpa"),
    "olmo2": ("Olmo2Config", {**GQA}, "sdpa"),
    "stablelm": ("StableLmConfig", {**GQA}, "sdpa"),
    "gpt_oss": ("GptOssConfig", {**GQA, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "sliding_window": 6, "intermediate_size": 32,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
                "eager"),
}


def make_config(name: str):
    cls_name, extra, _ = ARCHITECTURES[name]
    cfg = getattr(transformers, cls_name)(**{**COMMON, **extra})
    if name == "gpt2":
        cfg.n_inner = 96
    return cfg


# Falcon computes attention itself (no attention interface): it reads a PagedCache through the
# materialising fallback of `PagedKV`, with its stock attention.
OWN_ATTENTION = {"falcon"}


def make_pair(name: str, seed: int = 0):
    """(reference model with stock attention, same weights with "hf_paged" attention), fp32, eval."""
    cfg = make_config(name)
    ref_attn = ARCHITECTURES[name][2]
    torch.manual_seed(seed)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=ref_attn).eval()
    paged_attn = ref_attn if name in OWN_ATTENTION else hf_paged.ATTN_IMPLEMENTATION
    paged = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=paged_attn)
    paged.load_state_dict(ref.state_dict())
    assert ref.config._attn_implementation == ref_attn and paged.config._attn_implementation == paged_attn
    return ref, paged.eval()


def hybrid_cache_config(window: int, layer_types=("sliding_attention", "full_attention")):
    """A config for a bare PagedCache (no model): one K/V head of size 2, the given layer types."""
    return transformers.Gemma3TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                                         sliding_window=window, num_attention_heads=1, num_key_value_heads=1,
                                         head_dim=2, hidden_size=8, intermediate_size=8, vocab_size=96)


@functools.lru_cache(maxsize=None)
def shared_pair(name: str):
    """`make_pair` built once per test session, for tests that do not bind a cache to the model
    (binding installs a forward hook: those tests build their own pair)."""
    return make_pair(name)


def left_padded_batch(lengths=(9, 5, 13), vocab=96, seed=0):
    """input_ids / attention_mask for prompts of the given lengths, left padded with token 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}
