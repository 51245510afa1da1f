"""`generate_many(..., compile=True)`: packed steps through a compiled forward, no graph break, no recompile on
later steps and calls, the tokens of per-prompt `model.generate` (DynamicCache)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

import hf_paged
from hf_paged import compiled_many
from hf_paged.compiled_many import SteadyForward, ragged_attention
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


def counting_skips(monkeypatch) -> list:
    """Calls that `SteadyForward` runs without Dynamo's guards, one entry each, from now on."""
    skipped, real = [], compiled_many._skip_guards
    monkeypatch.setattr(compiled_many, "_skip_guards", lambda: skipped.append(1) or real())
    return skipped


def toy_step(input_ids, logits_to_keep):
    """A forward whose graph depends on the shapes: one token, fewer than 5, more (and the rows kept)."""
    scale = 2.0 if input_ids.shape[1] == 1 else 3.0 if input_ids.shape[1] < 5 else 4.0
    return (input_ids.float() * scale)[:, :logits_to_keep.shape[0]] + logits_to_keep.shape[0]


@pytest.mark.parametrize("shapes", [[(3, 2), (3, 2), (1, 1), (7, 2), (1, 1), (4, 4), (7, 2), (9, 3), (3, 2)],
                                    [(1, 1), (1, 1), (8, 8), (2, 2), (8, 8), (6, 1), (2, 2), (1, 1)]])
def test_steady_calls_skip_the_guards_and_new_shapes_still_find_their_graphs(fresh_dynamo, monkeypatch, shapes):
    """A call shaped like an earlier one skips Dynamo's guards; a new shape (one token, a count past a threshold,
    other kept rows), another grad mode or a reset Dynamo evaluates them (compiling what it must): every call gives
    the eager result, in either order of shapes."""
    skipped = counting_skips(monkeypatch)
    forward = SteadyForward(torch.compile(toy_step, backend="eager", dynamic=True), {})

    def check(t, k):
        ids, keep = torch.arange(t).view(1, t), torch.arange(k)
        assert torch.equal(forward(input_ids=ids, logits_to_keep=keep), toy_step(ids, keep))

    for t, k in shapes:
        check(t, k)
    assert len(skipped) == len(shapes) - len(set(shapes))
    with torch.no_grad():  # another global state: guards evaluated (the same graph), then steady
        check(*shapes[0])
        check(*shapes[0])
    assert len(skipped) == len(shapes) - len(set(shapes)) + 1
    torch._dynamo.reset()  # no graph left: the steady call recompiles instead of failing
    check(*shapes[0])
    check(*shapes[0])


def test_steady_steps_of_a_new_workload_give_generate_tokens(fresh_dynamo, monkeypatch):
    """A second run with other prompts and another step budget, its steps partly shaped like the first run's (those
    skip the guards) and partly new: DynamicCache's greedy tokens in both runs."""
    ref, model = make_pair("llama")
    hf_paged.compile_many_steps(model, backend="eager")
    skipped = counting_skips(monkeypatch)
    prompts = random_prompts()
    assert many(model, prompts, NEW) == generate_each(ref, prompts, NEW)
    first = len(skipped)
    others, news = random_prompts(seed=2)[:4], [5, 1, 9, 2]
    assert hf_paged.generate_many(model, others, max_new_tokens=news, compile=True, progress=False,
                                  max_batch_tokens=24, page_size=4) == generate_each(ref, others, news)
    assert first > 0 and len(skipped) > first


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
