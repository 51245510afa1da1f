"""Sampling in `generate_many` (issue 30, item 10 and the planted sampling bugs): every output draws with its own
CPU generator from CPU probabilities, so that sample ``j`` of prompt ``i`` equals that prompt sampled alone with
seed ``seed + i * num_return_sequences + j``, whatever else is batched, on any device; and the draws are those
of the same warpers over DynamicCache's logits."""

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import hf_paged
from batching_checks import sampled_alone
from test_generate_many import random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
SAMPLING = dict(do_sample=True, temperature=1.3, top_k=40, top_p=0.9)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


@pytest.mark.parametrize("page_size,max_batch_tokens", [(4, 7), (16, 256), (1, 3)])
def test_each_sample_is_its_prompt_alone_with_its_seed(llama, page_size, max_batch_tokens):
    """Three prompts (one of them twice), three samples each, in one run: each output equals the documented
    single-prompt, single-sample run: no forked sample draws with another's generator, no seed is shared."""
    _, paged = llama
    prompts = random_prompts((9, 14, 5), seed=12)
    prompts.append(prompts[0])
    news = [6, 4, 7, 5]
    kwargs = dict(page_size=page_size, eos_token_id=[], **SAMPLING)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=news, num_return_sequences=3, seed=11,
                                 max_batch_tokens=max_batch_tokens, progress=False, **kwargs)
    want = sampled_alone(paged, prompts, news, 3, 11, **{k: v for k, v in kwargs.items() if k != "do_sample"})
    assert got == want
    assert got[0:3] != got[9:12]  # the repeated prompt's samples have other seeds: other tokens


def test_a_seed_per_prompt_seeds_its_samples(llama):
    _, paged = llama
    prompts = random_prompts((9, 14), seed=13)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=5, num_return_sequences=2, seed=[100, 200],
                                 eos_token_id=[], progress=False, **SAMPLING)
    alone = [hf_paged.generate_many(paged, [p], max_new_tokens=5, seed=s + j, eos_token_id=[], progress=False,
                                    **SAMPLING)[0] for p, s in zip(prompts, (100, 200)) for j in range(2)]
    assert got == alone


def dynamic_cache_samples(ref, prompt, new, seeds):
    """The reference: per seed, ``ref`` with a DynamicCache, the same warpers (temperature, top-k, top-p) over its
    float32 logits and a CPU generator's multinomial draw per token."""
    warpers = [TemperatureLogitsWarper(SAMPLING["temperature"]), TopKLogitsWarper(SAMPLING["top_k"]),
               TopPLogitsWarper(SAMPLING["top_p"])]
    outputs = []
    for seed in seeds:
        generator, tokens, cache = torch.Generator().manual_seed(seed), list(prompt), DynamicCache(config=ref.config)
        step = torch.tensor([prompt])
        for _ in range(new):
            with torch.no_grad():
                logits = ref(input_ids=step, cache=cache).logits[0, -1].float()
            for warp in warpers:
                logits = warp(torch.tensor([tokens]), logits[None])[0]
            tokens.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)))
            step = torch.tensor([[tokens[-1]]])
        outputs.append(tokens[len(prompt):])
    return outputs


def test_samples_draw_what_dynamic_cache_logits_draw(llama):
    ref, paged = llama
    prompt = random_prompts((21,), seed=14)[0]
    got = hf_paged.generate_many(paged, [prompt], max_new_tokens=6, num_return_sequences=4, seed=3, eos_token_id=[],
                                 page_size=8, progress=False, **SAMPLING)
    assert got == dynamic_cache_samples(ref, prompt, 6, range(3, 7))
    assert len({tuple(s) for s in got}) > 1


class PretendCuda(torch.Tensor):
    """CPU logits that say they are on a CUDA device, as a GPU model's logits are: every op keeps the pretence,
    while a copy to the CPU (``.cpu()``, ``.to("cpu")``) is an ordinary CPU tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.cpu, torch.Tensor.to) and isinstance(out, PretendCuda):
            return out.as_subclass(torch.Tensor)
        return out

    @property
    def device(self):
        return torch.device("cuda", 0)


def test_draws_come_from_cpu_probabilities_with_a_cpu_generator(llama, monkeypatch):
    """The CUDA path on the CPU: the model's logits claim a CUDA device; `torch.multinomial` raises on CUDA when the
    generator is on another device than the probabilities (the bug: device probabilities, a CPU generator)."""
    _, paged = llama
    prompts = random_prompts((9, 14), seed=15)
    want = hf_paged.generate_many(paged, prompts, max_new_tokens=4, num_return_sequences=2, seed=5, eos_token_id=[],
                                  progress=False, **SAMPLING)
    real, draws = torch.multinomial, []

    def multinomial(probs, num_samples, generator=None, **kwargs):
        assert probs.device == generator.device == torch.device("cpu"), (probs.device, generator.device)
        draws.append(1)
        return real(probs, num_samples, generator=generator, **kwargs)

    def on_device(module, args, kwargs, output):
        output.logits = output.logits.as_subclass(PretendCuda)
        return output

    monkeypatch.setattr(torch, "multinomial", multinomial)
    handle = paged.register_forward_hook(on_device, with_kwargs=True)
    try:
        got = hf_paged.generate_many(paged, prompts, max_new_tokens=4, num_return_sequences=2, seed=5,
                                     eos_token_id=[], progress=False, **SAMPLING)
        greedy = hf_paged.generate_many(paged, prompts, max_new_tokens=4, eos_token_id=[], progress=False)
    finally:
        handle.remove()
    assert got == want and len(draws) == 2 * 2 * 4
    assert greedy == hf_paged.generate_many(paged, prompts, max_new_tokens=4, eos_token_id=[], progress=False)
