"""Continuous batching (`generate_many` / `stream_many`) against per-prompt `model.generate` with DynamicCache."""

import pytest
import torch

import hf_paged
from hf_paged.ragged_cache import RaggedCache
from tiny_models import ARCHITECTURES, OWN_ATTENTION, make_pair

LENGTHS = (5, 17, 33, 9, 40, 2)
NEW = (7, 20, 3, 12, 25, 9)


def random_prompts(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=g).tolist() for n in lengths]


def generate_each(model, prompts, news, **kwargs):
    """The reference: one `model.generate` per prompt (DynamicCache), new tokens only."""
    outs = []
    for prompt, new in zip(prompts, news):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0, **kwargs)
        outs.append(out[0, len(prompt):].tolist())
    return outs


class CountingForward:
    """Counts the tokens every forward of ``model`` computes."""

    def __init__(self, model):
        self.tokens = 0
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        self.tokens += kwargs["input_ids"].shape[1]


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


@pytest.mark.parametrize("name", sorted(set(ARCHITECTURES) - OWN_ATTENTION))
@pytest.mark.parametrize("page_size,max_batch_tokens", [(1, 64), (3, 7), (16, 256), (4, 1)])
def test_greedy_equals_generate_per_prompt(name, page_size, max_batch_tokens):
    ref, paged = make_pair(name)
    prompts = random_prompts()
    want = generate_each(ref, prompts, NEW, eos_token_id=None)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), page_size=page_size,
                                 max_batch_tokens=max_batch_tokens, eos_token_id=[], progress=False)
    assert got == want


def test_rows_join_while_others_decode_and_leave_at_their_stop_token(llama):
    ref, paged = llama
    prompts = random_prompts()
    want = generate_each(ref, prompts, NEW, eos_token_id=None)
    stop = want[3][4]  # a token prompt 3 produces: generation stops at (and includes) its first occurrence
    want = [w[:w.index(stop) + 1] if stop in w else w for w in want]
    events = list(hf_paged.stream_many(paged, prompts, max_new_tokens=list(NEW), eos_token_id=stop,
                                       max_batch_tokens=12, progress=False))
    got = [[t for i, t in events if i == k] for k in range(len(prompts))]
    assert got == want
    order = [i for i, _ in events]
    first_of_last = order.index(len(prompts) - 1)
    assert 0 in order[:first_of_last] and 1 in order[first_of_last + 1:]  # joined mid-run, others still going


def test_bounded_pool_makes_prompts_wait_and_gives_every_page_back(llama):
    ref, paged = llama
    prompts = random_prompts()
    want = generate_each(ref, prompts, NEW, eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=4, max_pages=20)  # about two prompts at a time
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(NEW), eos_token_id=[], cache=cache,
                                 progress=False)
    assert got == want
    assert cache.manager.num_pages <= 20
    assert cache.sequences == {} and cache.manager.num_used == 0
    cache.manager.check_invariants()


def test_a_prompt_larger_than_the_pool_is_refused_before_any_work(llama):
    _, paged = llama
    counter = CountingForward(paged)
    with pytest.raises(hf_paged.CacheUsageError, match="prompt 1 needs 15 pages"):
        hf_paged.generate_many(paged, [[5] * 4, [5] * 50], max_new_tokens=8, page_size=4, max_pages=10,
                               progress=False)
    assert counter.tokens == 0


@pytest.mark.parametrize("prompts,max_new,match", [
    ([[5, 6], []], 4, "prompt 1 is empty"),
    ([[5, 6], [7]], [4, -1], "prompt 1: max_new_tokens must be a positive int"),
    ([[5, 6], [7, 96]], 4, "prompt 1 holds token ids outside the vocabulary"),
    ([[5, 6]], [4, 4], "max_new_tokens has 2 entries for 1 prompts"),
])
def test_bad_requests_are_refused_before_any_work(llama, prompts, max_new, match):
    _, paged = llama
    counter = CountingForward(paged)
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.generate_many(paged, prompts, max_new_tokens=max_new, progress=False)
    assert counter.tokens == 0


def test_a_shared_system_prompt_is_computed_once(llama):
    ref, paged = llama
    system = random_prompts((48,), seed=7)[0]
    prompts = [system + p for p in random_prompts((3, 11, 6, 20), seed=8)]
    want = generate_each(ref, prompts, [5] * 4, eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=16)
    counter = CountingForward(paged)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=5, eos_token_id=[], cache=cache, progress=False)
    assert got == want
    assert cache.prefix_hits == 3 * 3  # the three later prompts share the system prompt's three pages
    assert counter.tokens == sum(map(len, prompts)) - 3 * 48 + 4 * 4


def test_samples_of_one_prompt_share_its_pages_and_are_reproducible(llama):
    _, paged = llama
    prompt = random_prompts((21,))[0]
    counter = CountingForward(paged)
    kwargs = dict(max_new_tokens=6, do_sample=True, temperature=1.5, top_k=20, top_p=0.95, num_return_sequences=4,
                  eos_token_id=[], page_size=8, progress=False)
    first = hf_paged.generate_many(paged, [prompt], seed=3, **kwargs)
    assert counter.tokens == 21 + 4 * 5  # the prompt once, then one token per sample and step
    assert first == hf_paged.generate_many(paged, [prompt], seed=3, **kwargs)
    alone = {**kwargs, "num_return_sequences": 1}  # the reference: each sample alone, with its documented seed
    assert first == [hf_paged.generate_many(paged, [prompt], seed=3 + j, **alone)[0] for j in range(4)]
    assert len({tuple(s) for s in first}) > 1  # the samples differ from each other
    assert first != hf_paged.generate_many(paged, [prompt], seed=4, **kwargs)


def test_a_reused_cache_serves_a_later_call_from_its_prefix_pages(llama):
    ref, paged = llama
    prompts = random_prompts((40, 35), seed=5)
    want = generate_each(ref, prompts, [6, 6], eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=8)
    assert hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache,
                                  progress=False) == want
    assert cache.prefix_hits == 0
    assert hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache,
                                  progress=False) == want
    assert cache.prefix_hits == 4 + 4  # (40 - 1) // 8 and (35 - 1) // 8 full pages


def test_a_failed_step_leaves_the_cache_consistent(llama):
    _, paged = llama
    cache = RaggedCache(paged.config, page_size=4)
    calls = {"n": 0}

    def fail_third_step(module, args, kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("planted failure")

    handle = paged.model.layers[1].register_forward_pre_hook(fail_third_step, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="planted failure"):
            hf_paged.generate_many(paged, random_prompts(), max_new_tokens=5, cache=cache, progress=False)
    finally:
        handle.remove()
    assert cache.sequences == {} and cache.manager.num_used == 0 and cache.step is None
    cache.manager.check_invariants()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_backends_give_the_same_tokens(llama, backend):
    ref, paged = llama
    prompts = random_prompts((6, 13, 3))
    want = generate_each(ref, prompts, [4, 4, 4], eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=4, backend=backend)
    assert hf_paged.generate_many(paged, prompts, max_new_tokens=4, eos_token_id=[], cache=cache,
                                  progress=False) == want


def test_a_model_without_hf_paged_attention_is_refused(llama):
    ref, _ = llama
    with pytest.raises(hf_paged.CacheUsageError, match="attn_implementation='hf_paged'"):
        hf_paged.generate_many(ref, [[5, 6]], max_new_tokens=2, progress=False)


def test_identical_prompts_are_read_once(llama):
    ref, paged = llama
    prompt, other = random_prompts((19, 7), seed=9)
    prompts = [prompt, other, prompt, prompt]
    news = [4, 6, 9, 2]
    want = generate_each(ref, prompts, news, eos_token_id=None)
    counter = CountingForward(paged)
    cache = RaggedCache(paged.config, page_size=4, max_pages=40)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=news, eos_token_id=[], cache=cache, progress=False)
    assert got == want
    assert counter.tokens == 19 + 7 + sum(n - 1 for n in news)  # each distinct prompt once, then one token a step
    assert cache.manager.num_used == 0
