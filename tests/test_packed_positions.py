"""The positions of a packed `generate_many` step (issue 30, planted bug: every position +1 went unnoticed: RoPE
models see only relative positions, and the absolute-position test model repeated one token whatever its
positions). Each segment's positions are its sequence's next ones, checked in the step itself, and a model whose
output follows its absolute positions gives `generate`'s tokens."""

import pytest
import torch

import hf_paged
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_each_segment_gets_its_sequence_next_positions():
    """A forward pre-hook reads every step's ``position_ids`` against the cache's plan: segment s of a step holds
    positions ``past .. past + length - 1`` of its sequence (prefill chunks, decode tokens, shared prefixes)."""
    _, paged = make_pair("llama")
    system = random_prompts((9,), seed=20)[0]
    prompts = [system + p for p in random_prompts((4, 11, 2), seed=21)] + [random_prompts((6,), seed=22)[0]]
    cache = RaggedCache(paged.config, page_size=4)
    seen = []

    def check_positions(module, args, kwargs):
        positions = kwargs["position_ids"][0].tolist()
        for segment in cache.step.segments:
            got = positions[segment.start:segment.start + segment.length]
            assert got == list(range(segment.past, segment.past + segment.length)), (segment, got)
            seen.append(segment.length)

    handle = paged.register_forward_pre_hook(check_positions, with_kwargs=True)
    try:
        hf_paged.generate_many(paged, prompts, max_new_tokens=[5, 3, 6, 4], max_batch_tokens=8, eos_token_id=[],
                               cache=cache, progress=False)
    finally:
        handle.remove()
    assert 1 in seen and max(seen) > 1 and cache.prefix_hits > 0  # decode tokens, prefill chunks, a shared prefix


def test_an_absolute_position_model_gives_generates_tokens():
    """GPT-2 (learned absolute position embeddings), its position embeddings scaled up so that its greedy tokens
    follow the positions (the tiny random model otherwise repeats one token): the tokens of `generate`."""
    ref, paged = make_pair("gpt2")
    with torch.no_grad():
        for model in (ref, paged):
            model.transformer.wpe.weight.mul_(30)
    prompts = random_prompts((5, 17, 9), seed=23)
    news = [8, 6, 9]
    want = generate_each(ref, prompts, news, eos_token_id=None)
    assert all(len(set(w)) > 2 for w in want), want  # the positions show in the tokens
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=news, page_size=4, max_batch_tokens=7,
                                 eos_token_id=[], progress=False)
    assert got == want
