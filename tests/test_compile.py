"""`torch.compile` with a PagedCache: a steady decode step is one graph, no recompile, the tokens of DynamicCache."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from transformers import DynamicCache

import hf_paged
from tiny_models import make_pair

CACHE = hf_paged.CACHE_KWARG


def graph_counts() -> tuple[int, int]:
    """(graphs Dynamo compiled, graph breaks it met) so far."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def greedy_steps(model, cache, prompt: torch.Tensor, steps: int, after_warmup=None):
    """Prefill ``prompt``, then ``steps`` greedy decode steps; ``after_warmup()`` runs after the first two. Returns the
    tokens [B, steps] and the last logits."""
    with torch.no_grad():
        return _greedy_steps(model, cache, prompt, steps, after_warmup)


def _greedy_steps(model, cache, prompt, steps, after_warmup):
    logits = model(prompt, **{CACHE: cache}).logits[:, -1]
    tokens = []
    for step in range(steps):
        if step == 2 and after_warmup is not None:
            after_warmup()
        tokens.append(logits.argmax(-1, keepdim=True))
        logits = model(tokens[-1], **{CACHE: cache}).logits[:, -1]
    return torch.cat(tokens, dim=1), logits


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_steady_decode_is_one_graph_without_recompiles(fresh_dynamo, backend):
    """Prefill, two warm-up steps, then steady steps that cross page boundaries and grow the pool: no recompile (an
    error), no new graph or graph break, and DynamicCache's greedy tokens and logits."""
    ref, model = make_pair("llama")
    prompt = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    want, want_logits = greedy_steps(ref, DynamicCache(), prompt, 14)
    compiled = torch.compile(hf_paged.plan_compiled_steps(model), backend=backend)
    cache = hf_paged.PagedCache(page_size=4, config=model.config, backend="cpu")
    seen = []

    def warm():
        seen.append(graph_counts())
        torch._dynamo.config.error_on_recompile = True

    try:
        got, logits = greedy_steps(compiled, cache, prompt, 14, after_warmup=warm)
    finally:
        torch._dynamo.config.error_on_recompile = False
    assert graph_counts() == seen[0]
    assert seen[0][1] == 0, counters["graph_break"]
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 9 + 14


def test_generate_with_a_compiled_forward_on_a_left_padded_batch(fresh_dynamo):
    """`model.forward = torch.compile(model.forward)` and generate: the padding mask reaches the kernel aligned."""
    ref, model = make_pair("llama")
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    options = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, attention_mask=mask, **options, **{CACHE: DynamicCache()})
    model.forward = torch.compile(hf_paged.plan_compiled_steps(model).forward, backend="eager")
    got = model.generate(ids, attention_mask=mask, **options, **{CACHE: hf_paged.PagedCache(4, config=model.config)})
    assert torch.equal(got, want)


def test_plain_torch_compile_without_the_hook_gives_the_same_tokens(fresh_dynamo):
    """Without `plan_compiled_steps` the first layer plans each step (a graph break): slower, still correct."""
    ref, model = make_pair("llama")
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(2))
    want, _ = greedy_steps(ref, DynamicCache(), prompt, 3)
    got, _ = greedy_steps(torch.compile(model, backend="eager"), hf_paged.PagedCache(4, config=model.config),
                          prompt, 3)
    assert torch.equal(got, want)


def test_a_forward_that_fails_before_its_first_layer_leaves_the_cache_as_it_was():
    """The hook planned a step whose forward then failed (a token id outside the vocabulary): the next step rolls it
    back instead of keeping slots nobody wrote. (The hook's path runs eagerly too: no compiler needed here.)"""
    ref, model = make_pair("llama")
    prompt = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(3))
    want, _ = greedy_steps(ref, DynamicCache(), prompt, 4)
    hf_paged.plan_compiled_steps(model)
    cache = hf_paged.PagedCache(4, config=model.config)
    logits = model(prompt, **{CACHE: cache}).logits[:, -1]
    with pytest.raises(IndexError):
        model(torch.tensor([[10_000]]), **{CACHE: cache})
    tokens = []
    for _ in range(4):
        tokens.append(logits.argmax(-1, keepdim=True))
        logits = model(tokens[-1], **{CACHE: cache}).logits[:, -1]
    assert torch.equal(torch.cat(tokens, dim=1), want)
    assert cache.get_seq_length() == 6 + 4


def test_a_cache_that_needs_its_layers_up_front_says_so():
    _, model = make_pair("llama")
    hf_paged.plan_compiled_steps(model)
    with pytest.raises(hf_paged.CacheUsageError, match="config=model.config"):
        model(torch.tensor([[5, 6]]), **{CACHE: hf_paged.PagedCache(4)})


def test_quantized_pages_are_refused_under_the_hook_before_any_work():
    _, model = make_pair("llama")
    hf_paged.plan_compiled_steps(model)
    cache = hf_paged.PagedCache(4, config=model.config, kv_format="int8")
    with pytest.raises(hf_paged.CacheUsageError, match="kv_format='int8'"):
        model(torch.tensor([[5, 6]]), **{CACHE: cache})
    assert cache.get_seq_length() == 0
