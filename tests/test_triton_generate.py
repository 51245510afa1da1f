"""Whole `generate` runs through the Triton kernel (interpreter on CPU) match DynamicCache."""

import importlib.util

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from tiny_models import left_padded_batch, make_pair

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
GEN = dict(max_new_tokens=5, pad_token_id=0, eos_token_id=None)


@pytest.mark.parametrize("name,mode", [("llama", "greedy"), ("gemma2", "greedy"), ("qwen2", "beam"),
                                       ("gpt_oss", "greedy")])
def test_generate_through_triton_kernel(name, mode, monkeypatch):
    ref, paged = make_pair(name)
    batch = left_padded_batch((5, 3, 7))
    extra = dict(num_beams=3, do_sample=False) if mode == "beam" else dict(do_sample=False)
    want = ref.generate(**batch, **GEN, **extra, cache=DynamicCache(config=ref.config),
                        return_dict_in_generate=True, output_scores=True)
    calls = []
    from hf_paged.kernels import triton_paged_attention as kernel

    original = kernel.paged_attention_triton
    monkeypatch.setattr(kernel, "paged_attention_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    cache = hf_paged.PagedCache(page_size=3, config=paged.config, backend="triton")
    got = paged.generate(**batch, **GEN, **extra, cache=cache, return_dict_in_generate=True, output_scores=True)
    assert calls, "the Triton kernel was not used"
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.scores[0], want.scores[0], atol=1e-4, rtol=1e-4)


def test_backend_env_variable_selects_kernel(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")
    _, paged = make_pair("llama")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        paged.generate(**left_padded_batch((3,)), **GEN, cache=hf_paged.PagedCache(page_size=4))


def test_backend_env_variable_forces_the_kernel_on_cpu(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "triton")
    ref, paged = make_pair("llama")
    from hf_paged.kernels import triton_paged_attention as kernel

    calls = []
    original = kernel.paged_attention_triton
    monkeypatch.setattr(kernel, "paged_attention_triton", lambda *a, **k: calls.append(1) or original(*a, **k))
    batch = left_padded_batch((4, 6))
    got = paged.generate(**batch, **GEN, cache=hf_paged.PagedCache(page_size=2))
    assert calls and torch.equal(got, ref.generate(**batch, **GEN))


def test_a_cold_format_cache_decodes_through_triton_as_through_the_torch_path(monkeypatch):
    """A mixed-precision cache (``cold_format="int4"``, pages demoted during the run): the Triton kernel reads both
    tiers in place and gives the torch path's (gathers') tokens, logits within 1e-4."""
    _, paged = make_pair("llama")
    batch = left_padded_batch((5, 3, 7))
    from hf_paged.kernels import triton_paged_attention as kernel

    calls = []
    original = kernel.paged_attention_triton
    monkeypatch.setattr(kernel, "paged_attention_triton",
                        lambda *a, **k: calls.append(k.get("cold") is not None) or original(*a, **k))
    runs = []
    for backend in ("triton", "torch"):
        cache = hf_paged.PagedCache(page_size=1, max_pages=24, config=paged.config, cold_format="int4",
                                    eviction="fifo", backend=backend)
        runs.append(paged.generate(**batch, **dict(GEN, max_new_tokens=12), do_sample=False, cache=cache,
                                   return_dict_in_generate=True, output_logits=True))
        assert cache.stats()["demotions"] > 0
    assert calls and all(calls)
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    torch.testing.assert_close(torch.stack(runs[0].logits), torch.stack(runs[1].logits), atol=1e-4, rtol=1e-4)
