"""`generate_many(..., compile=True)`: packed steps through a compiled forward, no graph break, no recompile on
later steps and calls, the tokens of per-prompt `model.generate` (DynamicCache)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import hf_paged
from hf_paged.compiled_many import ragged_attention
from test_compile import fresh_dynamo, graph_counts  # noqa: F401 (a fixture)
from test_generate_many import NEW, generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def many(model, prompts, news, **kwargs):
    return hf_paged.generate_many(model, prompts, max_new_tokens=list(news), compile=True, progress=False,
                                  max_batch_tokens=16, page_size=4, **kwargs)


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", ["llama", "gemma3", "gpt_oss"])
def test_compiled_steps_give_generate_tokens_without_breaks_or_recompiles(fresh_dynamo, name, backend):
    """A run whose steps mix prefill chunks, decode rows and one-row steps (the first one a prefill chunk that emits
    no token: inductor then dropped the whole forward, the slot writes with it, until such steps kept a row): DynamicCache's greedy tokens, no graph
    break, at most three graphs (one-token steps, one emitting row, several; one more for steps at least as long as
    a sliding window, a guard of transformers' mask, built and not read); a second run on a new cache with
    shared prompt prefixes recompiles nothing (an error) and gives the same tokens."""
    ref, model = make_pair(name)
    prompts = random_prompts()
    prompts = [prompts[4], *prompts, prompts[1] + [5, 6, 7]]  # the first step emits nothing; the last shares pages
    news = [3, *NEW, 4]
    want = generate_each(ref, prompts, news)
    hf_paged.compile_many_steps(model, backend=backend)
    assert many(model, prompts, news) == want
    graphs, breaks = graph_counts()
    assert breaks == 0 and 1 <= graphs <= 3 + (name in ("gemma3", "gpt_oss"))
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert many(model, prompts, news) == want
    assert graph_counts() == (graphs, breaks)


def test_sampling_through_the_compiled_forward_equals_eager_sampling(fresh_dynamo):
    ref, model = make_pair("llama")
    prompts = random_prompts()
    kwargs = dict(do_sample=True, temperature=0.8, top_k=20, seed=3)
    want = hf_paged.generate_many(model, prompts, max_new_tokens=list(NEW), progress=False, max_batch_tokens=16,
                                  page_size=4, **kwargs)
    hf_paged.compile_many_steps(model, backend="eager")
    assert many(model, prompts, NEW, **kwargs) == want


def test_compile_with_packed_weights_is_refused_clearly():
    _, model = make_pair("llama")
    with pytest.raises(hf_paged.CacheUsageError, match="packs the linear weights itself"):
        many(model, random_prompts(), NEW, pack_weights=True)
    with hf_paged.packed_linear_weights(model), pytest.raises(hf_paged.CacheUsageError, match="unpack the model"):
        many(model, random_prompts(), NEW)


def test_the_attention_op_outside_a_run_says_what_drives_it():
    q = torch.zeros(1, 4, 2, 16)
    with pytest.raises(hf_paged.CacheUsageError, match="generate_many"):
        ragged_attention(q, q[:, :2], q[:, :2], 0, 0.25, None, None, None)


def test_the_compiled_forward_is_kept_on_the_model_until_recompile_is_asked(fresh_dynamo):
    _, model = make_pair("llama")
    first = hf_paged.compile_many_steps(model, backend="eager")
    assert hf_paged.compile_many_steps(model, backend="eager") is first
    assert hf_paged.compile_many_steps(model, backend="eager", recompile=True) is not first
