"""Bad arguments to `generate_many` and `RaggedCache` (issue 30, items 5 and 9): a clear `CacheUsageError` naming
the argument, before any forward; never a hang, a ZeroDivisionError, an IndexError or a silently truncated
float. Integers of other types (NumPy, a 0-d tensor) are ints."""

import numpy as np
import pytest
import torch

import hf_paged
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import CountingForward, generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


@pytest.mark.parametrize("kwargs,match", [
    (dict(page_size=-4), "page_size must be a positive int"),
    (dict(page_size=0), "page_size must be a positive int"),
    (dict(page_size=2.0), "page_size must be a positive int"),
    (dict(page_size=2**20), "page_size must be a positive int of at most 65536"),
    (dict(max_pages=0), "max_pages must be None"),
    (dict(max_pages=-3), "max_pages must be None"),
    (dict(num_return_sequences=0), "num_return_sequences must be a positive int"),
    (dict(num_return_sequences=2.0), "num_return_sequences must be an int"),
    (dict(max_new_tokens=4.0), "max_new_tokens must be an int or a list of ints, got 4.0"),
    (dict(max_new_tokens=torch.tensor(4.0)), "max_new_tokens must be an int or a list of ints"),
    (dict(max_new_tokens=[4, 2.5]), r"each of max_new_tokens must be an int, got 2.5"),
    (dict(max_new_tokens="4"), "max_new_tokens must be an int or a list of ints"),
    (dict(max_new_tokens=0), "max_new_tokens must be a positive int"),
    (dict(max_batch_tokens=0), "max_batch_tokens must be a positive int"),
    (dict(max_batch_tokens=8.5), "max_batch_tokens must be an int"),
    (dict(do_sample="yes"), "do_sample must be True or False"),
    (dict(do_sample=True, temperature=0), "temperature must be a positive number"),
    (dict(do_sample=True, temperature=float("nan")), "temperature must be a positive number"),
    (dict(do_sample=True, top_k=-1), "top_k must be None, 0"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be None or a number in \(0, 1\]"),
    (dict(do_sample=True, seed=1.5), "seed must be an int or a list of ints"),
    (dict(do_sample=True, seed=[1, 2, 3]), "seed has 3 entries for 2 prompts"),
    (dict(eos_token_id=2.0), "eos_token_id must be an int or a list of ints"),
    (dict(backend="gpu"), "backend must be 'auto'"),
    (dict(cache="a cache"), "cache must be a RaggedCache"),
])
def test_bad_arguments_are_refused_before_any_forward(llama, kwargs, match):
    _, paged = llama
    counter = CountingForward(paged)
    kwargs = dict(kwargs)
    backend = kwargs.pop("backend", None)
    call = {"max_new_tokens": 4, "progress": False, **kwargs}
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        if backend is not None:
            RaggedCache(paged.config, backend=backend)
        hf_paged.generate_many(paged, [[5, 6, 7], [8, 9]], **call)
    assert counter.tokens == 0


@pytest.mark.parametrize("prompts,match", [
    ([[5.0, 6.7]], r"prompt 0's token ids must be an int, got 5.0"),
    ([[5, 6], torch.tensor([7.0, 8.0])], "prompt 1 is a torch.float32 tensor: token ids are ints"),
    ([[5, 6], [7, None]], "prompt 1's token ids must be an int, got None"),
])
def test_float_token_ids_are_refused_not_truncated(llama, prompts, match):
    _, paged = llama
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.generate_many(paged, prompts, max_new_tokens=2, progress=False)


@pytest.mark.parametrize("make", [np.int64, torch.tensor, lambda n: torch.tensor([n])])
def test_integers_of_other_types_are_ints(llama, make):
    """NumPy integers and integer tensors of one element are ints: for max_new_tokens, token ids and seeds."""
    ref, paged = llama
    prompts = random_prompts((6, 9), seed=4)
    want = generate_each(ref, prompts, [3, 3], eos_token_id=None)
    typed = [[make(t) for t in p] for p in prompts]
    assert hf_paged.generate_many(paged, typed, max_new_tokens=make(3), eos_token_id=[], progress=False) == want
    assert hf_paged.generate_many(paged, [np.array(p) for p in prompts], max_new_tokens=[make(3), 3],
                                  eos_token_id=[], progress=False) == want
    sampled = dict(max_new_tokens=3, do_sample=True, eos_token_id=[], progress=False)
    assert (hf_paged.generate_many(paged, prompts, seed=make(7), **sampled) ==
            hf_paged.generate_many(paged, prompts, seed=7, **sampled))


@pytest.mark.parametrize("kwargs,match", [
    (dict(config="a config"), "config must be a transformers model config"),
    (dict(page_size=-4), "page_size must be a positive int"),
    (dict(page_size=True), "page_size must be a positive int"),
    (dict(max_pages=0), "max_pages must be None"),
    (dict(backend="cuda"), "backend must be 'auto'"),
])
def test_ragged_cache_checks_what_paged_cache_checks(llama, kwargs, match):
    _, paged = llama
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        RaggedCache(**{"config": paged.config, **kwargs})
