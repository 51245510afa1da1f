"""Cold pages in `generate_many` / `RaggedCache` (issue 32): ``cold_format`` without a budget re-quantizes every
full page of a sequence but its sinks when the step that filled it is final, as `PagedCache(cold_format=...)` does,
through the same demotion (`hf_paged.demotion`); a prompt's pages stay float until it is read whole, in one chunk or
several, as a `PagedCache`'s prefill reads them. So greedy tokens equal one `generate` per prompt with a
`PagedCache(cold_format=...)`."""

import copy

import pytest
import torch

import hf_paged
from hf_paged.block_manager import EVICTED
from hf_paged.demotion import MixedPages
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import CountingForward, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = (5, 17, 33, 9, 40, 2)
NEW = (7, 20, 3, 12, 25, 9)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def generate_cold(model, prompts, news, page_size, cold_format):
    """The reference: one `model.generate` per prompt on a `PagedCache(cold_format=...)`, new tokens only."""
    outs = []
    for prompt, new in zip(prompts, news):
        cache = hf_paged.PagedCache(page_size=page_size, config=model.config, cold_format=cold_format)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0,
                             eos_token_id=None, cache=cache)
        outs.append(out[0, len(prompt):].tolist())
    return outs


def many(model, prompts, news, max_batch_tokens=256, **kwargs):
    return hf_paged.generate_many(model, prompts, max_new_tokens=list(news), max_batch_tokens=max_batch_tokens,
                                  eos_token_id=[], progress=False, **kwargs)


def check_tiers(cache):
    """Every group's tiers are consistent, every full page past a sequence's sinks is cold (the rest hot), and no
    cold page has a content hash (never shared)."""
    for g, group in enumerate(cache.groups):
        manager, cold = group.manager, group.manager.cold
        cold.check_invariants(manager)
        manager.check_invariants()
        want = {p for seq in cache.sequences.values()
                for p in seq.tables[g][cache.groups[0].sink_pages:seq.length // cache.page_size] if p != EVICTED}
        assert cold.ids == want
        assert not set(manager.page_hash) & cold.ids, "a cold page is hashed"


@pytest.mark.parametrize("name,cold_format,page_size,max_batch_tokens", [
    ("llama", "int4", 4, 256), ("llama", "int4", 16, 256), ("llama", "int8", 1, 256), ("gemma3", "int8", 4, 256),
    ("llama", "int4", 4, 7), ("llama", "int4", 16, 10), ("gemma3", "int4", 4, 1), ("llama", "int2", 4, 256),
    ("llama", "int2", 16, 10)])
def test_greedy_equals_generate_per_prompt_on_a_cold_paged_cache(name, cold_format, page_size, max_batch_tokens):
    """Same demotion schedule, same tokens, prompts read in one chunk or many (small ``max_batch_tokens``); the float
    pages' tokens differ (so the comparison can fail)."""
    _, model = make_pair(name)
    prompts = random_prompts(LENGTHS)
    want = generate_cold(model, prompts, NEW, page_size, cold_format)
    cache = RaggedCache(model.config, page_size=page_size, cold_format=cold_format)
    assert many(model, prompts, NEW, max_batch_tokens, cache=cache) == want
    assert cache.stats()["demotions"] > 0
    if (name, page_size) == ("llama", 4):
        assert many(model, prompts, NEW, page_size=page_size) != want


def test_pages_turn_cold_as_they_fill_and_kv_bytes_fall(llama):
    """While the run decodes: the tiers hold exactly the full pages past the sinks, and ``kv_bytes`` is a fraction of
    the float pages' at the same point (the schedule does not depend on the format)."""
    _, model = llama
    prompts = random_prompts((40, 33, 50), seed=3)
    seen = []
    caches = {cold: RaggedCache(model.config, page_size=4, cold_format=cold) for cold in (None, "int4")}
    streams = {cold: hf_paged.stream_many(model, prompts, max_new_tokens=30, cache=cache, eos_token_id=[],
                                          progress=False) for cold, cache in caches.items()}
    for count, _ in enumerate(zip(*streams.values())):
        if count % 10 == 9:
            check_tiers(caches["int4"])
            stats = {cold: cache.stats() for cold, cache in caches.items()}
            assert stats[None]["tokens_stored"] == stats["int4"]["tokens_stored"]
            seen.append((stats["int4"]["kv_bytes"] / stats[None]["kv_bytes"], stats["int4"]["pages_cold"]))
    assert seen and all(cold > 0 for _, cold in seen)
    assert max(ratio for ratio, _ in seen) < 0.35  # (int4: 0.154x a float32 page; sinks and filling pages float)


@pytest.mark.parametrize("max_batch_tokens", [256, 12])
def test_a_prompt_sharing_a_prefix_gets_its_own_tokens(llama, max_batch_tokens):
    """Prompts sharing 40 tokens (ten pages), read in one chunk: only the float sink page is shared (cold pages have no
    hash), again in a second run on the same cache; read in chunks, pages shared while a prompt is read stay float until
    every prompt holding them is read. Tokens equal the per-prompt runs."""
    _, model = llama
    base = random_prompts((40,), seed=5)[0]
    prompts = [base + tail for tail in random_prompts((3, 9, 20), seed=6)]
    news = [15, 10, 12]
    want = generate_cold(model, prompts, news, 4, "int4")
    cache = RaggedCache(model.config, page_size=4, cold_format="int4")
    for run in range(2):
        hits = cache.prefix_hits
        got = many(model, prompts, news, max_batch_tokens, cache=cache)
        assert got == want
        if max_batch_tokens == 256:
            assert cache.prefix_hits - hits == (2 if run == 0 else 3) * cache.groups[0].sink_pages
        cold = cache.manager.cold
        assert not set(cache.manager.page_hash) & cold.ids


def test_a_byte_budget_runs_more_at_once_and_keeps_the_tokens(llama):
    """``max_pages`` with a cold format counts float pages' bytes: pages turning cold make room, so the sequences
    run more at once (fewer steps than on float pages of the same budget) within those bytes, the tiers consistent
    after every step, with the same tokens."""
    _, model = llama
    prompts = random_prompts(LENGTHS)
    want = generate_cold(model, prompts, NEW, 4, "int4")
    steps = {}
    for cold_format in (None, "int4"):
        cache = RaggedCache(model.config, page_size=4, cold_format=cold_format, max_pages=17)
        outputs, stats = {}, hf_paged.GenerationStats()
        for index, token in hf_paged.stream_many(model, prompts, max_new_tokens=list(NEW), cache=cache, stats=stats,
                                                 max_batch_tokens=256, eos_token_id=[], progress=False):
            outputs.setdefault(index, []).append(token)
            if cold_format is not None:
                check_tiers(cache)
                hot, _ = cache.manager.cold.page_bytes()
                assert cache.store.held_bytes() <= 17 * hot
        steps[cold_format] = stats.summary()["steps"]
    assert [outputs[i] for i in range(len(prompts))] == want
    assert steps["int4"] < steps[None]


@pytest.mark.parametrize("kwargs,match", [
    (dict(cold_format="int3"), "cold_format='int3' is not a cold page format"),
    (dict(cold_format="int4", kv_format="int8"), "needs kv_format='float'"),
    (dict(cold_format="int4", prefix_store="memory://"), "cold_format and prefix_store cannot be combined"),
])
def test_bad_arguments_are_refused_as_paged_cache_refuses_them(llama, kwargs, match):
    _, model = llama
    counter = CountingForward(model)
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        RaggedCache(model.config, **kwargs)
    with pytest.raises(hf_paged.CacheUsageError, match=match):
        hf_paged.generate_many(model, [[5, 6, 7]], max_new_tokens=2, progress=False, **kwargs)
    config = copy.deepcopy(model.config)
    config.head_dim = 15
    with pytest.raises(hf_paged.CacheUsageError, match="packs 2 values a byte"):
        RaggedCache(config, cold_format="int4")
    assert counter.tokens == 0


def test_compile_is_refused_before_any_work(llama):
    _, model = llama
    with pytest.raises(hf_paged.CacheUsageError, match="compile=True reads one pool of pages per layer"):
        hf_paged.generate_many(model, [[5, 6, 7]], max_new_tokens=2, progress=False, compile=True,
                               cold_format="int4")
    assert "_hf_paged_compiled_many" not in model.__dict__  # (nothing compiled)


def test_the_cache_stays_usable_after_a_rejected_argument(llama):
    _, model = llama
    prompts = random_prompts((9, 21), seed=2)
    want = generate_cold(model, prompts, (6, 6), 4, "int4")
    cache = RaggedCache(model.config, page_size=4, cold_format="int4")
    for kwargs, match in ((dict(cold_format="int8"), "cold_format='int8' with cache="),
                          (dict(compile=True), "compile=True reads one pool")):
        with pytest.raises(hf_paged.CacheUsageError, match=match):
            many(model, prompts, (6, 6), cache=cache, **kwargs)
    assert many(model, prompts, (6, 6), cache=cache, cold_format="int4") == want
    assert many(model, prompts, (6, 6), cache=cache) == want
    assert cache.stats()["pages_cold"] == 0 and not any(cache.manager.ref)


def test_freed_pages_give_their_rows_back_once_per_layer_not_every_step(llama, monkeypatch):
    """A layer's pages drop the rows of the pool's free pages when pages were freed since its last write (the block
    manager's ``frees``), not at every step: once at the first step, once after a sequence finished, whose pages then
    hold no rows while the other sequence decodes on."""
    _, model = llama
    calls = []
    forget = MixedPages.forget_residuals
    monkeypatch.setattr(MixedPages, "forget_residuals", lambda self, pages: (calls.append(1), forget(self, pages)))
    cache = RaggedCache(model.config, page_size=4, cold_format="int4")
    stream = hf_paged.stream_many(model, random_prompts((9, 30), seed=7), max_new_tokens=[2, 20], cache=cache,
                                  eos_token_id=[], progress=False)
    counts = [0, 0]
    for index, _ in stream:
        counts[index] += 1
        if counts[1] == 10:
            break
    free = list(cache.manager.free)
    assert counts[0] == 2 and free  # (the short sequence's pages but its hashed sink page)
    for layer in cache.manager.cold.layers.values():
        assert (layer.hot_row[free] < 0).all() and (layer.cold_row[free] < 0).all()
    assert len(calls) == 2 * model.config.num_hidden_layers
    stream.close()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_other_backends_read_the_cold_pages_as_the_c_kernel(llama, backend):
    """The torch path (gathers) and the Triton kernel (interpreted on the CPU) give the C kernel's tokens."""
    _, model = llama
    prompts = random_prompts((6, 21, 37), seed=9)
    caches = {name: RaggedCache(model.config, page_size=4, cold_format="int4", backend=name)
              for name in ("cpu", backend)}
    got = {name: many(model, prompts, (8, 8, 8), cache=cache) for name, cache in caches.items()}
    assert got[backend] == got["cpu"] and caches[backend].stats()["demotions"] > 0
