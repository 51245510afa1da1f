"""The QuantizedCache peer of scripts/quantized.py (`hf_paged.evaluation.quantized_peer`): without optimum-quanto
its rows are skipped with a reason; with it, a fork decodes without touching the cache it came from, and the bytes
count the quantized history and the float residual."""

import sys

import pytest
import torch
import transformers
from tiny_models import make_config

from hf_paged import CACHE_KWARG
from hf_paged.evaluation import quantized_peer as peer

pytestmark = pytest.mark.usefixtures("one_thread")
needs_quanto = pytest.mark.skipif(peer.unavailable_reason() is not None, reason=str(peer.unavailable_reason()))


def tiny_llama():
    """A random llama with head dim 64 (quanto's groups of 64 must divide a token's row), "sdpa", no EOS."""
    config = make_config("llama")
    config.hidden_size, config.head_dim = 128, 64
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    return model


def test_without_optimum_quanto_the_reason_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "optimum.quanto", None)  # import optimum.quanto raises ImportError
    reason = peer.unavailable_reason()
    assert reason is not None and "optimum-quanto" in reason and "eval" in reason


@needs_quanto
def test_a_fork_decodes_without_changing_the_cache_it_came_from():
    """Decoding past the residual (so the fork re-quantizes its history) leaves the original's tensors and length
    as they were; two forks of it generate the same tokens."""
    model = tiny_llama()
    prompt = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    cache = peer.make_cache(model.config, 4, residual_length=8)
    with torch.no_grad():
        model(input_ids=prompt[:, :-1], use_cache=True, **{CACHE_KWARG: cache})
    before = [(layer._quantized_keys, layer._quantized_keys.dequantize().clone()) for layer in cache.layers]
    runs = [model.generate(input_ids=prompt, **{CACHE_KWARG: peer.fork(cache)}, max_new_tokens=12, do_sample=False,
                           pad_token_id=0) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert cache.get_seq_length() == prompt.shape[1] - 1
    for layer, (tensor, values) in zip(cache.layers, before):
        assert layer._quantized_keys is tensor and torch.equal(tensor.dequantize(), values)


@needs_quanto
def test_bytes_count_the_quantized_history_and_the_float_residual():
    model = tiny_llama()
    cache = peer.make_cache(model.config, 4, residual_length=8)
    ids = torch.randint(3, 96, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{CACHE_KWARG: cache})
        quantized = peer.kv_bytes(cache)
        model(input_ids=ids[:, :3], use_cache=True, **{CACHE_KWARG: cache})  # 3 tokens into the float residual
    layer = cache.layers[0]
    assert layer.keys.shape[-2] == 3
    residual = 2 * sum(layer.keys.numel() * layer.keys.element_size() for layer in cache.layers)
    assert peer.kv_bytes(cache) == quantized + residual
    full = sum(2 * layer._quantized_keys.numel() * 4 for layer in cache.layers)  # the same history in float32
    assert 0.1 * full < quantized < 0.25 * full  # 4-bit codes plus a scale and a shift per group
