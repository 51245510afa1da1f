"""Mixed precision (issue 32, `hf_paged.demotion`): under a budget, `PagedCache(max_pages=M, cold_format=...)` holds M
float pages' bytes per layer group and re-quantizes its coldest pages before it evicts any; without one, every full page
but a row's sinks turns cold before the next step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hf_paged
from hf_paged.demotion import ColdPages, MixedPages, cold_page_format
from hf_paged.kv_formats import QuantizedPages, dequantize, page_format, quantize
from test_failed_step import _decode, _fail_after_layer
from tiny_models import left_padded_batch, make_config, make_pair, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def _groups(cache):
    return [g for g in cache.groups.values()]


def _check_budget(cache, max_pages):
    """Every group holds at most ``max_pages`` float pages' bytes, and its tiers are consistent."""
    for group in _groups(cache):
        manager, tiers = group.manager, group.manager.cold
        tiers.check_invariants(manager)
        manager.check_invariants()
        hot, _ = tiers.page_bytes()
        assert group.store.held_bytes() <= max_pages * hot


def _feed(model, cache, ids, chunk, after=None):
    """Feed ``ids [B, T]`` in chunks; ``after(step, logits)`` after each forward. -> logits ``[B, T, V]``."""
    out = []
    with torch.no_grad():
        for step, start in enumerate(range(0, ids.shape[1], chunk)):
            logits = model(input_ids=ids[:, start:start + chunk], **{hf_paged.CACHE_KWARG: cache}).logits
            out.append(logits)
            if after is not None:
                after(step, logits)
    return torch.cat(out, 1)


def _ids(batch, length, seed=0):
    return torch.randint(3, 96, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------- policy
@pytest.mark.parametrize("page_size", [1, 2])
def test_cold_pages_are_demoted_before_any_eviction(page_size):
    _, model = shared_pair("llama")
    max_pages = 12
    cache = hf_paged.PagedCache(page_size=page_size, max_pages=max_pages, config=model.config, cold_format="int4")
    seen = dict(first_eviction=None)

    def after(step, _):
        stats = cache.stats()
        for group in _groups(cache):
            rows, tiers, S = group.rows, group.manager.cold, page_size
            if group.eviction.evictions:  # every full page but the sinks is cold once anything was evicted
                sinks = cache.policy.sink_pages - group.first_page
                full = group.num_tokens // S - group.first_page
                hot = [p for row in rows for i, p in enumerate(row[:full]) if p >= 0 and i >= sinks
                       and p not in tiers.ids]
                written = {p for row in rows for p in row[-math.ceil(4 / S) - 1:]}  # this step's pages
                assert set(hot) <= written
        if stats["evictions"] and seen["first_eviction"] is None:
            seen["first_eviction"] = stats["tokens_held"]
        _check_budget(cache, max_pages)

    _feed(model, cache, _ids(1, 160), 4, after)
    # the bytes of 12 float pages held over twice their tokens before the first eviction (4 sinks and a chunk stay hot)
    assert seen["first_eviction"] is not None and seen["first_eviction"] >= 2 * max_pages * page_size
    assert cache.stats()["demotions"] > 0


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.integers(1, 3), extra=st.integers(0, 8), cold=st.sampled_from(["int4", "int2", "int8"]),
       eviction=st.sampled_from(["score", "lru", "fifo"]), batch=st.integers(1, 2),
       chunks=st.lists(st.integers(1, 3), min_size=4, max_size=14), per_layer=st.booleans())
def test_the_byte_budget_is_never_exceeded(page_size, extra, cold, eviction, batch, chunks, per_layer):
    _, model = shared_pair("llama")
    max_pages = batch * (math.ceil(4 / page_size) + 2 + 3) + extra  # per row: sinks, recent, a chunk's pages
    cache = hf_paged.PagedCache(page_size=page_size, max_pages=max_pages, config=model.config, cold_format=cold,
                                eviction=eviction, per_layer_eviction=per_layer)
    ids = _ids(batch, sum(chunks) * 4, seed=len(chunks))
    start = 0
    with torch.no_grad():
        for chunk in chunks * 4:
            model(input_ids=ids[:, start:start + chunk], **{hf_paged.CACHE_KWARG: cache})
            start += chunk
            _check_budget(cache, max_pages)
    stats = cache.stats()
    hot_bytes = sum(g.manager.cold.page_bytes()[0] for g in _groups(cache))
    assert stats["kv_bytes"] <= max_pages * hot_bytes


# ----------------------------------------------------------------------------------------- pages
@pytest.mark.parametrize("cold", ["int4", "int2", "int8"])
def test_demoted_pages_read_back_within_the_format_tolerance(cold):
    S, H, D, pages_n = 2, 2, 16, 6
    tiers = ColdPages(cold, S)
    layer = tiers.make_layer(0, S, H, D, D, torch.float32, "cpu")
    layer.grow_to(pages_n)
    g = torch.Generator().manual_seed(0)
    keys64 = torch.randn(pages_n * S, H, D, generator=g, dtype=torch.float64) * 3
    values64 = torch.randn(pages_n * S, H, D, generator=g, dtype=torch.float64)
    layer.write(torch.arange(pages_n * S), keys64.float(), values64.float())
    demoted = np.array([1, 3, 4])
    layer.demote(demoted)
    keys, values = layer.gather(torch.arange(pages_n))
    keys, values = keys.flatten(0, 1), values.flatten(0, 1)
    cold_slots = torch.tensor([p * S + s for p in demoted for s in range(S)])
    hot_slots = torch.tensor([i for i in range(pages_n * S) if i // S not in demoted])
    assert torch.equal(keys[hot_slots], keys64[hot_slots].float())  # hot pages are the float pages
    assert torch.equal(values[hot_slots], values64[hot_slots].float())
    fmt = tiers.format
    for read, x64, codec in ((keys, keys64, fmt.key), (values, values64, fmt.value)):
        x = x64[cold_slots].float()
        assert torch.equal(read[cold_slots], dequantize(codec, *quantize(codec, x), D))  # what the format stores
        # within half a quantization step of every group (in the codec's rotated basis), against float64
        rotated = x64[cold_slots] @ hf_paged.kv_formats.rotation(D).double() if codec.rotated else x64[cold_slots]
        groups = rotated.unflatten(-1, (codec.groups(D), -1))
        levels = {"int4": 15, "int2": 3, "int8": 254}[cold]
        spread = (groups.amax(-1) - groups.amin(-1)) if cold != "int8" else 2 * groups.abs().amax(-1)
        half_step = (spread / levels / 2 * 1.01 + 1e-3)[..., None].expand_as(groups).flatten(-2)
        error = read[cold_slots].double() - x64[cold_slots]
        error = error @ hf_paged.kv_formats.rotation(D).double() if codec.rotated else error
        assert (error.abs() <= half_step).all()


def test_a_write_into_a_cold_page_starts_it_hot():
    S, H, D = 4, 1, 8
    tiers = ColdPages("int4", S)
    layer = tiers.make_layer(0, S, H, D, D, torch.float32, "cpu")
    layer.grow_to(2)
    x = torch.randn(2 * S, H, D, generator=torch.Generator().manual_seed(1))
    layer.write(torch.arange(2 * S), x, x)
    layer.demote(np.array([0, 1]))
    tiers.ids.update((0, 1))
    decoded, _ = layer.gather(torch.tensor([0]))
    new = torch.full((1, H, D), 7.0)
    layer.write(torch.tensor([2]), new, new)  # into the middle of page 0 (as after a crop): decoded back to hot
    layer.write(torch.tensor([S]), new, new)  # from the first slot of page 1: a fresh page
    keys, _ = layer.gather(torch.tensor([0, 1]))
    assert torch.equal(keys[0, :2], decoded[0, :2]) and torch.equal(keys[0, 2], new[0])
    assert torch.equal(keys[1, 0], new[0])
    assert layer.hot_row[0] >= 0 and layer.cold_row[0] < 0 and layer.cold_row[1] < 0 and not tiers.ids
    assert isinstance(layer, MixedPages)


# ----------------------------------------------------------------------------------------- cache
def test_tokens_equal_the_plain_bounded_cache_while_nothing_is_demoted():
    _, model = shared_pair("llama")
    ids = _ids(2, 64, seed=3)
    mixed = hf_paged.PagedCache(page_size=1, max_pages=48, config=model.config, cold_format="int4")
    plain = hf_paged.PagedCache(page_size=1, max_pages=48, config=model.config)  # both read by the C kernel
    compared = 0
    with torch.no_grad():
        for start in range(0, 64, 2):
            a = model(input_ids=ids[:, start:start + 2], **{hf_paged.CACHE_KWARG: mixed}).logits
            b = model(input_ids=ids[:, start:start + 2], **{hf_paged.CACHE_KWARG: plain}).logits
            if mixed.stats()["demotions"]:
                break
            # (the two-tier entry point of the kernel is another compiled instance of the same loops: the float
            # sums may be associated differently)
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            compared += 1
    assert compared >= 10 and mixed.stats()["demotions"] > 0
    # greedy generation with room for everything: the same tokens as the plain bounded cache (its C kernel)
    prompt = _ids(1, 12, seed=4)
    outs = [model.generate(prompt, max_new_tokens=16, do_sample=False, cache=hf_paged.PagedCache(
        page_size=2, max_pages=64, config=model.config, **kw)) for kw in (dict(cold_format="int4"), {})]
    assert torch.equal(outs[0], outs[1])


def _kernel_reads_cold_pages(monkeypatch) -> list[bool]:
    """Per C kernel call from now on: whether it read cold pages (the list grows as the kernel runs)."""
    seen = []
    real = hf_paged.attention.cpu_kernel.paged_attention_cpu

    def counting(*args, cold=None, **kw):
        seen.append(cold is not None and bool((cold.cold_row >= 0).any()))
        return real(*args, cold=cold, **kw)

    monkeypatch.setattr(hf_paged.attention.cpu_kernel, "paged_attention_cpu", counting)
    return seen


@pytest.mark.parametrize("cold", ["int4", "int2", "int8"])
def test_the_kernel_reads_both_tiers_as_the_torch_path_does(cold, monkeypatch):
    """Decoding a batch past many demotions (and evictions) with ``cold_format``: the C kernel reading both tiers in
    place gives the logits of the torch path (gathers) within 1e-4 and the same greedy tokens; the kernel runs on
    pages of both tiers. (Within 1e-7 until a decoded token is demoted: the two paths write keys and values that
    differ in the last bits, and where one lies on a rounding boundary of its cold code, the codes differ by one step,
    which moves the logits by about 3e-5 from then on, by how much depending on the CPU's vector width.)"""
    _, model = shared_pair("llama")
    batch = left_padded_batch((9, 5, 13))
    seen = _kernel_reads_cold_pages(monkeypatch)
    runs = {}
    for backend in ("cpu", "torch"):
        cache = hf_paged.PagedCache(page_size=1, max_pages=40, config=model.config, cold_format=cold, backend=backend,
                                    eviction="fifo")  # (demoted and evicted by age: the same pages in both runs)
        out = model.generate(**batch, max_new_tokens=100 if cold == "int2" else 60,  # (int2 holds more: evicts later)
                             do_sample=False, cache=cache, output_logits=True, return_dict_in_generate=True)
        runs[backend] = out, cache.stats()
    (kernel, stats), (torch_path, _) = runs["cpu"], runs["torch"]
    assert stats["demotions"] > 20 and stats["evictions"] > 0 and any(seen)
    assert torch.equal(kernel.sequences, torch_path.sequences)
    torch.testing.assert_close(torch.stack(kernel.logits), torch.stack(torch_path.logits), rtol=0, atol=1e-4)


def test_forks_share_cold_pages_and_copy_on_write():
    _, model = shared_pair("llama")
    ids = _ids(1, 61, seed=5)
    caches = []
    for fork in (True, False):
        cache = hf_paged.PagedCache(page_size=3, max_pages=8, config=model.config, cold_format="int4")
        _feed(model, cache, ids, 5)
        assert cache.stats()["demotions"] > 0
        cache.set_max_pages(None)  # room for both continuations: what they read is the demoted prefix
        caches.append((cache, cache.fork()) if fork else (cache,))
    tail = _ids(1, 7, seed=6)
    logits = [[], [], []]
    with torch.no_grad():  # the caches alternate token by token: a write into the shared partial page is copied first
        for t in range(tail.shape[1]):
            for out, cache in zip(logits, [c for pair in caches for c in pair]):
                out.append(model(input_ids=tail[:, t:t + 1], **{hf_paged.CACHE_KWARG: cache}).logits)
    original, fork, alone = (torch.cat(out, 1) for out in logits)
    assert torch.equal(original, alone)  # the fork changed nothing the original reads
    torch.testing.assert_close(fork, alone, rtol=0, atol=1e-5)  # (an unbounded fork reads without usage probes)
    for group in _groups(caches[0][0]):
        group.manager.cold.check_invariants(group.manager)


def test_beams_within_the_byte_budget():
    _, model = shared_pair("llama")
    cache = hf_paged.PagedCache(page_size=1, max_pages=24, config=model.config, cold_format="int4")

    class Check:  # a logits processor: the cache as the beams left it, every step
        def __call__(self, input_ids, scores):
            _check_budget(cache, 24)
            return scores

    model.generate(_ids(1, 12, seed=7), max_new_tokens=40, num_beams=3, do_sample=False, cache=cache,
                   logits_processor=[Check()])
    stats = cache.stats()
    assert stats["demotions"] > 0 and stats["pages_cold"] > 0
    _check_budget(cache, 24)


def test_a_failed_step_rolls_back_and_its_retry_is_exact():
    _, model = shared_pair("llama")
    batch = left_padded_batch((9, 5, 13))
    make = lambda: hf_paged.PagedCache(page_size=1, max_pages=40, config=model.config,  # noqa: E731
                                       cold_format="int8")
    reference = make()
    expected = _decode(model, reference, batch, 30)
    cache = make()
    got = _decode(model, cache, batch, 30, fail_at=28, fail_in=_fail_after_layer(1))  # pages demoted and evicted
    assert reference.stats()["demotions"] > 0 and reference.stats()["evictions"] > 0
    # (after an eviction a retried step's live pages may sit in another column order, as in a plain bounded cache:
    # the same sums in another order)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    _check_budget(cache, 40)


def test_bad_arguments_are_refused_before_any_work():
    with pytest.raises(hf_paged.CacheUsageError, match="cold_format='int3'"):
        hf_paged.PagedCache(max_pages=4, cold_format="int3")
    with pytest.raises(hf_paged.CacheUsageError, match="kv_format='float'"):
        hf_paged.PagedCache(max_pages=4, cold_format="int4", kv_format="int8")
    with pytest.raises(hf_paged.CacheUsageError, match="kv_format='float'"):  # (no budget: demoted as they fill)
        hf_paged.PagedCache(cold_format="int4", kv_format="int4")
    config = make_config("llama")
    config.head_dim = 15
    with pytest.raises(hf_paged.CacheUsageError, match="cold_format='int4' packs 2 values a byte"):
        hf_paged.PagedCache(cold_format="int4", config=config)
    config.head_dim = 18
    with pytest.raises(hf_paged.CacheUsageError, match="cold_format='int2' packs 4 values a byte and needs a head_dim "
                                                       "divisible by 4, the model's is 18; choose one of 'float', "
                                                       "'int8', 'int4'$"):
        hf_paged.PagedCache(cold_format="int2", config=config)


def test_the_evaluation_script_adds_cold_format_rows_at_the_same_budgets():
    from hf_paged.evaluation import long_context as study
    from script_commands import Command
    from tiny_models import make_config

    script = Command("evaluation", study)
    args = script.parse_args(["--cold-format", "int4", "--regimes", "compress", "--policies", "score",
                              "--budgets", "128", "--windows", "1"])
    methods = {(j["method"], j["budget"], j["kv_format"]) for j in script.continuation_jobs(args)}
    assert methods == {("full", None, "float"), ("hf_paged score", 128, "float"),
                       ("hf_paged score, cold int4", 128, "float+int4")}
    model = type("Model", (), {"config": make_config("llama")})()
    cache = study.bounded_cache(model, args, "score", "compress", 128, "float+int4")
    assert (cache.kv_format, cache.cold_format, cache.max_pages) == ("float", "int4", 128)
    with pytest.raises(SystemExit):
        script.parse_args(["--cold-format", "int3"])


def test_torch_compile_is_refused_with_a_reason():
    """A compiled forward's custom op reads one pool per layer: a cache with two tiers is refused, saying so.
    (Its own model: `plan_compiled_steps` hooks the model for good.)"""
    _, model = make_pair("llama")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(hf_paged.plan_compiled_steps(model), backend="eager")
        cache = hf_paged.PagedCache(page_size=1, max_pages=24, config=model.config, cold_format="int4",
                                    eviction="fifo")
        with torch.no_grad(), pytest.raises(hf_paged.CacheUsageError, match="cold_format=None under torch.compile"):
            for start in range(0, 12, 4):
                compiled(_ids(1, 12)[:, start:start + 4], **{hf_paged.CACHE_KWARG: cache})
    finally:
        torch._dynamo.reset()


# ------------------------------------------------------------------------------------------- without a budget
@pytest.mark.parametrize("page_size", [16, 2])
def test_cold_pages_are_the_page_formats_by_page_size(page_size):
    """int4 cold pages of 16 tokens are the "int4" page format's, code for code (keys per channel within the page);
    smaller ones keep per-token keys (a page's parameters would cost more than its tokens' groups)."""
    H, D, n = 2, 16, 3
    tiers = ColdPages("int4", page_size)
    layer = tiers.make_layer(0, page_size, H, D, D, torch.float32, "cpu")
    layer.grow_to(n)
    x = torch.randn(n * page_size, H, D, generator=torch.Generator().manual_seed(2)) * 2
    layer.write(torch.arange(n * page_size), x, x.flip(-1))
    layer.demote(np.array([0, 2]))
    assert getattr(tiers.format.key, "per_page", False) == (page_size >= 16)
    if page_size >= 16:
        pages = QuantizedPages(page_format("int4"), page_size, H, D, D, torch.float32, "cpu")
        pages.grow_to(n)
        pages.write(torch.arange(n * page_size), x, x.flip(-1))
        rows = torch.from_numpy(layer.cold_row[[0, 2]])
        for name in ("k_codes", "k_scale", "v_codes", "v_scale"):
            assert torch.equal(getattr(layer.cold, name)[rows], getattr(pages, name)[[0, 2]]), name
    per_token = QuantizedPages(cold_page_format("int4", 1), page_size, H, D, D, torch.float32, "cpu")
    per_token.grow_to(1)
    assert layer.cold_page_bytes == per_token.page_bytes()  # in pages of 16: the same bytes as per-token keys
    assert layer.cold_page_bytes < 0.2 * layer.hot_page_bytes


@pytest.mark.parametrize("page_size", [16, 3])
def test_without_a_budget_every_full_page_but_the_sinks_turns_cold(page_size):
    """``cold_format`` without ``max_pages``: before each step, every full page of a row past its sink pages is cold;
    the sinks and the page being filled are read in float; ``kv_bytes`` counts each tier at its bytes; the prefill
    reads float pages (the plain cache's logits, up to float rounding: the plain cache's prefill runs in the C
    prefill kernel, a two-tier layer's through SDPA; int4 pages would move them by far more)."""
    _, model = shared_pair("llama")
    ids = _ids(2, 70, seed=8)
    cache = hf_paged.PagedCache(page_size=page_size, config=model.config, cold_format="int4")
    plain = hf_paged.PagedCache(page_size=page_size, config=model.config)
    sinks = cache.policy.sink_pages
    prompt = 37
    with torch.no_grad():
        first = model(input_ids=ids[:, :prompt], **{hf_paged.CACHE_KWARG: cache}).logits
        torch.testing.assert_close(first, model(input_ids=ids[:, :prompt], **{hf_paged.CACHE_KWARG: plain}).logits,
                                   rtol=1e-5, atol=1e-5)
        for t in range(prompt, ids.shape[1]):
            model(input_ids=ids[:, t:t + 1], **{hf_paged.CACHE_KWARG: cache})
            for group in _groups(cache):
                full = t // page_size  # pages full before this step
                want = {p for row in group.rows for p in row[sinks:full]}
                assert group.manager.cold.ids == want
                group.manager.cold.check_invariants(group.manager)
                layers = group.manager.cold.layers.values()
                held = len({p for row in group.rows for p in row})
                assert group.store.held_bytes() == sum((held - len(want)) * layer.hot_page_bytes
                                                       + len(want) * layer.cold_page_bytes for layer in layers)
    stats = cache.stats()
    assert stats["pages_cold"] == len(cache.groups) * 2 * (ids.shape[1] // page_size - sinks)  # (committed: demoted)
    assert stats["kv_bytes"] < 0.5 * plain.stats()["kv_bytes"] * ids.shape[1] / prompt


@pytest.mark.parametrize("page_size", [16, 4])
def test_without_a_budget_the_kernel_reads_as_the_torch_path_with_beams(page_size, monkeypatch):
    """Beam search on a cache without a budget (pages turn cold as they fill, shared by the beams): the C kernel
    reading both tiers in place gives the torch path's tokens and logits within 2e-5."""
    _, model = shared_pair("llama")
    batch = left_padded_batch((19, 5, 33))
    seen = _kernel_reads_cold_pages(monkeypatch)
    runs = {}
    for backend in ("cpu", "torch"):
        cache = hf_paged.PagedCache(page_size=page_size, config=model.config, cold_format="int4", backend=backend)
        out = model.generate(**batch, max_new_tokens=40, num_beams=2, do_sample=False, cache=cache,
                             output_scores=True, return_dict_in_generate=True)
        runs[backend] = out, cache.stats()
        for group in _groups(cache):
            group.manager.cold.check_invariants(group.manager)
    (kernel, stats), (torch_path, _) = runs["cpu"], runs["torch"]
    assert stats["demotions"] > 0 and any(seen)
    assert torch.equal(kernel.sequences, torch_path.sequences)
    torch.testing.assert_close(torch.stack(kernel.scores), torch.stack(torch_path.scores), rtol=0, atol=2e-5)


def test_without_a_budget_a_failed_step_retries_exactly():
    _, model = shared_pair("llama")
    batch = left_padded_batch((9, 5, 13))
    make = lambda: hf_paged.PagedCache(page_size=4, config=model.config, cold_format="int4")  # noqa: E731
    reference = make()
    expected = _decode(model, reference, batch, 30)
    cache = make()
    got = _decode(model, cache, batch, 30, fail_at=24, fail_in=_fail_after_layer(1))
    assert reference.stats()["demotions"] > 0
    assert torch.equal(got, expected)
