"""Caches with quantized pages (issue 32 items 1 and 3): `PagedCache(kv_format=...)`, `RaggedCache` and
`generate_many` store int8/int4 pages, and everything the caches do still works on them.

The reference for "works": transformers' `DynamicCache` with stock attention, holding what such pages hand back
(each token quantized and dequantized by `hf_paged.kv_formats`, `SimulatedPages`): the paged cache must give the
same tokens and logits within float tolerance (the kernels dequantize in their own order). Against float pages,
logits agree within the format's stated tolerance up to the first token where the two runs differ, and they
differ only where float pages' own top-2 margin is below that tolerance.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

import hf_paged
from hf_paged.backends import layer_backend
from hf_paged.errors import CacheUsageError
from hf_paged.evaluation.quantized import Scheme, SimulatedPages, codec_roundtrip, page_keys_roundtrip
from hf_paged.kv_formats import page_format
from hf_paged.page_store import PageStore, make_layer_pages
from hf_paged.prefix_index import model_fingerprint
from page_checks import check_pages
from tiny_models import left_padded_batch, make_config, make_pair, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")

FORMATS = ("int8", "int4", "int2")
GEN = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, do_sample=False, output_logits=True,
           return_dict_in_generate=True)
SAME = 2e-4  # logits of the paged cache and the reference holding the same dequantized keys and values
AGAINST_FLOAT = {"int8": 0.02, "int4": 0.3, "int2": 0.6}  # largest logit change from float pages on these tiny models
CROP_INTO_FULL_PAGE = 1e-3  # int4 logits after a crop into a full page against exact keys: 5e-5 (zeros for the
# tokens it held, instead of what it hands back: 0.006)


def reference(model, kv_format: str, page_size: int = 4) -> SimulatedPages:
    """A DynamicCache holding what pages of ``kv_format`` hand back."""
    fmt = page_format(kv_format)
    if getattr(fmt.key, "per_page", False):  # int4, int2: keys per channel within pages of the cache's size
        keys, page = page_keys_roundtrip(fmt.key, page_size), page_size
    else:
        keys, page = codec_roundtrip(fmt.key), 0
    return SimulatedPages(Scheme(kv_format, keys, codec_roundtrip(fmt.value), 0, page_size=page), config=model.config)


def paged_cache(model, kv_format: str, page_size: int = 4, **kwargs) -> hf_paged.PagedCache:
    return hf_paged.PagedCache(page_size=page_size, config=model.config, kv_format=kv_format, **kwargs)


def logits_of(out) -> torch.Tensor:
    return torch.stack(out.logits)


def assert_same_run(got, want) -> None:
    assert torch.equal(got.sequences, want.sequences)
    assert (logits_of(got) - logits_of(want)).abs().max() < SAME


# ------------------------------------------------------------------------------------------- generate
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma3"])  # full, sliding window, hybrid layer groups
def test_greedy_generate_reads_what_its_pages_hold(name, kv_format):
    ref, paged = shared_pair(name)
    batch = left_padded_batch((11, 6, 9))
    want = ref.generate(**batch, **GEN, cache=reference(ref, kv_format))
    cache = paged_cache(paged, kv_format)
    got = paged.generate(**batch, **GEN, cache=cache)
    assert_same_run(got, want)
    assert {layer._resolved_backend for layer in cache.layers} == {"cpu"}  # decode steps in the C kernel
    check_pages(cache)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_the_torch_path_reads_the_same_pages(kv_format):
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((11, 6, 9))
    want = ref.generate(**batch, **GEN, cache=reference(ref, kv_format))
    assert_same_run(paged.generate(**batch, **GEN, cache=paged_cache(paged, kv_format, backend="torch")), want)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("kv_format", FORMATS)
def test_the_triton_kernel_reads_the_same_pages(kv_format, monkeypatch):
    """Under TRITON_INTERPRET=1 on the CPU (conftest), on CUDA when there is one."""
    from hf_paged.kernels import triton_paged_attention as kernel

    ref, paged = shared_pair("llama")
    batch = left_padded_batch((5, 3, 7))
    gen = dict(GEN, max_new_tokens=4)
    want = ref.generate(**batch, **gen, cache=reference(ref, kv_format, page_size=3))
    calls, original = [], kernel.paged_attention_triton
    monkeypatch.setattr(kernel, "paged_attention_triton", lambda *a, **k: calls.append(k["kv_format"]) or
                        original(*a, **k))
    assert_same_run(paged.generate(**batch, **gen, cache=paged_cache(paged, kv_format, page_size=3,
                                                                     backend="triton")), want)
    assert set(calls) == {kv_format}


@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_quantized_pages_change_logits_within_the_stated_tolerance_of_float_pages(name, kv_format):
    _, paged = shared_pair(name)
    batch = left_padded_batch((11, 6, 9))
    floats = paged.generate(**batch, **GEN, cache=paged_cache(paged, "float"))
    quantized = paged.generate(**batch, **GEN, cache=paged_cache(paged, kv_format))
    new = floats.sequences.shape[1] - len(floats.logits)
    tolerance = AGAINST_FLOAT[kv_format]
    for row in range(len(floats.sequences)):  # a row's logits follow the same tokens up to its first difference
        differs = (floats.sequences[row, new:] != quantized.sequences[row, new:]).nonzero()
        steps = int(differs[0]) + 1 if len(differs) else len(floats.logits)
        want, got = logits_of(floats)[:steps, row], logits_of(quantized)[:steps, row]
        assert (want - got).abs().max() < tolerance
        if len(differs):  # a different token comes from a near tie of float pages' logits
            top2 = want[-1].topk(2).values
            assert top2[0] - top2[1] < 2 * tolerance


def test_a_bfloat16_model_decodes_int8_pages_in_the_c_kernel():
    pages = make_layer_pages("int8", 4, 2, 16, 16, torch.bfloat16, "cpu")
    assert layer_backend("cpu", pages) == "cpu" and layer_backend("auto", pages) == "cpu"
    assert layer_backend("cpu", make_layer_pages("float", 4, 2, 16, 16, torch.float16, "cpu")) == "torch"


# -------------------------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("kv_format,bytes_per_head", [("float", 2 * 4 * 16), ("int8", 2 * (16 + 2)),
                                                      ("int4", 8 + (8 + 1 + 2))])
def test_kv_bytes_count_the_pages_scales_included(kv_format, bytes_per_head):
    """int4: codes per token and head (8 + 8 bytes at head dim 16, and a value's float16 scale and int8 zero),
    48 bytes per page and head of key parameters (16 float16 minima, 16 float8 steps), and each row's partial
    last page's float32 keys (4 tokens, 16 channels, a head)."""
    _, paged = shared_pair("qwen3")
    cache = paged_cache(paged, kv_format)
    paged.generate(**left_padded_batch((11, 6, 9)), **dict(GEN, max_new_tokens=9), cache=cache)  # rows of 19
    stats = cache.stats()
    layers, heads, S = paged.config.num_hidden_layers, paged.config.num_key_value_heads, cache.page_size
    used = stats["pages_used"] + stats["pages_cached"]
    per_page = S * bytes_per_head + (48 if kv_format == "int4" else 0)
    residual = 3 * S * 16 * 4 if kv_format == "int4" else 0
    assert stats["kv_bytes"] == (used * per_page + residual) * layers * heads > 0


# --------------------------------------------------------------------------------- sharing, forks
@pytest.mark.parametrize("kv_format", FORMATS)
def test_beam_search_on_quantized_pages(kv_format):
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((11, 6))
    gen = dict(GEN, num_beams=3, num_return_sequences=2)
    want = ref.generate(**batch, **gen, cache=reference(ref, kv_format))
    cache = paged_cache(paged, kv_format)
    got = paged.generate(**batch, **gen, cache=cache)
    assert torch.equal(got.sequences, want.sequences)
    check_pages(cache)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_samples_share_the_prompt_pages(kv_format):
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((11, 6))
    gen = dict(GEN, do_sample=True, num_return_sequences=3, top_k=0)
    torch.manual_seed(5)
    want = ref.generate(**batch, **gen, cache=reference(ref, kv_format))
    torch.manual_seed(5)
    cache = paged_cache(paged, kv_format)
    got = paged.generate(**batch, **gen, cache=cache)
    assert_same_run(got, want)
    check_pages(cache)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_forks_copy_a_shared_partial_page_with_its_scales(kv_format):
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((10, 7))  # 10 tokens: a partial third page of 4
    g = torch.Generator().manual_seed(3)
    questions = [torch.randint(3, 96, (2, n), generator=g) for n in (5, 3)]
    gen = dict(GEN, max_new_tokens=6)

    def extend(q):
        return dict(input_ids=torch.cat([batch["input_ids"], q], 1),
                    attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(q)], 1))

    prompt_ref, prompt = reference(ref, kv_format), paged_cache(paged, kv_format)
    with torch.no_grad():
        ref(**batch, cache=prompt_ref)
        paged(**batch, cache=prompt)
    used = prompt.stats()["pages_used"]
    forks = [prompt.fork(), copy.deepcopy(prompt)]
    assert prompt.stats()["pages_used"] == used  # shared, nothing copied yet
    for q, fork in zip(questions, forks):
        want = ref.generate(**extend(q), **gen, cache=copy.deepcopy(prompt_ref))
        assert_same_run(paged.generate(**extend(q), **gen, cache=fork), want)
    check_pages(prompt, *forks)
    # the prompt's own pages were copied, never overwritten: it continues as if no fork had written
    want = ref.generate(**extend(questions[0]), **gen, cache=copy.deepcopy(prompt_ref))
    assert_same_run(paged.generate(**extend(questions[0]), **gen, cache=prompt), want)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_crop_and_reorder_on_quantized_pages(kv_format):
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((11, 6, 9))
    order = torch.tensor([2, 0, 0])
    caches = {"ref": reference(ref, kv_format), "paged": paged_cache(paged, kv_format)}
    logits = {}
    for kind, model in (("ref", ref), ("paged", paged)):
        cache, ids, mask = caches[kind], batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
            cache.crop(-3)
            cache.reorder_cache(order)
            ids, mask = ids[order, -3:], torch.cat([mask[order, :-3], mask[order, -3:]], 1)
            logits[kind] = model(input_ids=ids, attention_mask=mask, cache=cache).logits
    assert (logits["ref"] - logits["paged"]).abs().max() < SAME
    check_pages(caches["paged"])


def test_crop_back_into_a_full_int4_page_requantizes_what_it_held():
    """Crop to 6 tokens (pages of 4): the second page, filled by the prefill, holds 2 tokens and no residual; the
    next forward writes on into it, from what it hands back (quantized a second time: `QuantizedPages`), so its
    logits stay close to the reference that keeps exact keys."""
    ref, paged = shared_pair("llama")
    batch = left_padded_batch((11, 6, 9))
    logits = {}
    for kind, model, cache in (("ref", ref, reference(ref, "int4")), ("paged", paged, paged_cache(paged, "int4"))):
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, cache=cache)
            cache.crop(-5)
            logits[kind] = model(input_ids=ids[:, 6:9], attention_mask=mask[:, :9], cache=cache).logits
        if kind == "paged":
            check_pages(cache)
    assert (logits["ref"] - logits["paged"]).abs().max() < CROP_INTO_FULL_PAGE


def test_int4_residuals_are_held_for_live_pages_only():
    """Forks that decode and end leave pages (with residuals) free; the next write drops those residuals, so
    ``kv_bytes`` counts the float keys of the live rows' partial pages only (one page a row and layer here)."""
    _, paged = shared_pair("llama")
    batch = left_padded_batch((10, 7))  # 10 tokens: each row's third page of 4 is partial
    cache = paged_cache(paged, "int4")
    with torch.no_grad():
        paged(**batch, cache=cache)
    question = torch.tensor([[7, 8], [9, 10]])
    longer = dict(input_ids=torch.cat([batch["input_ids"], question], 1),
                  attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(question)], 1))
    for _ in range(3):
        fork = cache.fork()
        paged.generate(**longer, **dict(GEN, max_new_tokens=6), cache=fork)
        fork.reset()
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], 1)
    with torch.no_grad():
        paged(input_ids=torch.tensor([[5], [6]]), attention_mask=mask, cache=cache)
    config = paged.config
    one = 4 * config.num_key_value_heads * config.head_dim * 4  # a page's float32 keys, one layer
    residual = sum(layer.pages.residual_bytes() for layer in cache.layers)
    assert residual == 2 * config.num_hidden_layers * one
    check_pages(cache)


# ------------------------------------------------------------------------------------ prefix caching
def test_prefix_pages_are_reused_within_a_format_and_never_across_formats():
    _, paged = make_pair("llama")  # binding installs a forward hook: a model of its own
    batch = left_padded_batch((13, 13))
    caches = {f: hf_paged.PagedCache(page_size=4, model=paged, kv_format=f) for f in ("float", *FORMATS)}
    assert len({cache.fingerprint(paged) for cache in caches.values()}) == 1 + len(FORMATS)
    for kv_format in FORMATS:
        cache = caches[kv_format]
        first = paged.generate(**batch, **GEN, cache=cache)
        cache.reset()
        before = cache.stats()["prefix_hits"]
        again = paged.generate(**batch, **GEN, cache=cache)
        assert cache.stats()["prefix_hits"] - before == 2 * (13 // 4)  # both rows' full prompt pages
        assert_same_run(again, first)
        check_pages(cache)


def test_generate_many_reuses_its_quantized_prefix_pages_under_the_formats_hash_root():
    _, paged = shared_pair("llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (21, 14)]
    cache = hf_paged.RaggedCache(paged.config, page_size=4, kv_format="int8")
    kwargs = dict(max_new_tokens=5, eos_token_id=[], cache=cache, progress=False)
    first = hf_paged.generate_many(paged, prompts, **kwargs)
    assert cache.prefix_hits == 0
    assert hf_paged.generate_many(paged, prompts, **kwargs) == first
    assert cache.prefix_hits == 5 + 3  # (21 - 1) // 4 and (14 - 1) // 4 full pages
    windows = [layer.sliding_window for layer in cache.layers]
    roots = {f: model_fingerprint(paged, 4, windows, f) for f in ("float", "int8", "int4")}
    assert len(set(roots.values())) == 3 and roots["float"] == model_fingerprint(paged, 4, windows)


# ----------------------------------------------------------------------------- eviction and windows
@pytest.mark.parametrize("eviction", ["score", "fifo"])
def test_a_bounded_cache_evicts_quantized_pages(eviction):
    _, paged = shared_pair("llama")
    batch = left_padded_batch((20, 14))
    floats = paged_cache(paged, "float", max_pages=12, eviction=eviction)
    cache = paged_cache(paged, "int8", max_pages=12, eviction=eviction)
    gen = dict(GEN, max_new_tokens=16)
    want = paged.generate(**batch, **gen, cache=floats)
    got = paged.generate(**batch, **gen, cache=cache)
    stats = cache.stats()
    assert stats["evictions"] > 0 and stats["pages_used"] <= 12 * len(cache.groups)
    new = want.sequences.shape[1] - len(want.logits)
    if eviction == "fifo":  # the same pages leave: only the format differs
        assert stats["evictions"] == floats.stats()["evictions"]
        same = (want.sequences[:, new:] == got.sequences[:, new:]).all(0)
        steps = int(same.logical_not().nonzero()[0]) + 1 if not same.all() else len(want.logits)
        assert (logits_of(want)[:steps] - logits_of(got)[:steps]).abs().max() < AGAINST_FLOAT["int8"]
    check_pages(cache)


@pytest.mark.parametrize("kv_format", FORMATS)
def test_sliding_window_pages_are_freed(kv_format):
    ref, paged = shared_pair("mistral")  # window 7
    batch = left_padded_batch((20, 14))
    cache = paged_cache(paged, kv_format)
    want = ref.generate(**batch, **dict(GEN, max_new_tokens=20), cache=reference(ref, kv_format))
    assert_same_run(paged.generate(**batch, **dict(GEN, max_new_tokens=20), cache=cache), want)
    assert cache.stats()["tokens_stored"] <= 2 * (7 + 2 * 4)  # per row: the window and at most two pages more


# --------------------------------------------------------------------------------------- generate_many
@pytest.mark.parametrize("kv_format", FORMATS)
def test_generate_many_equals_generate_on_the_same_pages(kv_format):
    _, paged = shared_pair("llama")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 17, 9, 30)]
    news = [7, 12, 3, 9]
    want = []
    for prompt, new in zip(prompts, news):
        out = paged.generate(torch.tensor([prompt]), **dict(GEN, max_new_tokens=new),
                             cache=paged_cache(paged, kv_format))
        want.append(out.sequences[0, len(prompt):].tolist())
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=news, page_size=4, max_batch_tokens=16,
                                 eos_token_id=[], progress=False, kv_format=kv_format)
    assert got == want


# --------------------------------------------------------------------------------------- failed steps
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("fail_at", [2, 3])  # the step writing position 11 fills a page of 4 (int4: its last write)
def test_a_failed_step_leaves_quantized_pages_as_they_were(kv_format, fail_at):
    _, paged = shared_pair("llama")
    batch = left_padded_batch((10, 7))
    runs = {}
    for fail in (False, True):
        cache = paged_cache(paged, kv_format)
        ids, mask, logits = batch["input_ids"], batch["attention_mask"], []
        for step in range(6):
            if fail and step == fail_at:
                layer = paged.model.layers[1].mlp
                handle = layer.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
                with pytest.raises(RuntimeError, match="boom"):
                    paged(input_ids=ids, attention_mask=mask, cache=cache)
                handle.remove()
            with torch.no_grad():
                out = paged(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]
            logits.append(out)
            ids, mask = out.argmax(-1, keepdim=True), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        runs[fail] = torch.stack(logits)
        check_pages(cache)
    assert torch.equal(runs[True], runs[False])


# -------------------------------------------------------------------------------------------- errors
def test_a_format_the_device_cannot_read_is_refused_before_any_work():
    _, paged = shared_pair("llama")
    with pytest.raises(CacheUsageError, match=r"kv_format='fp8_e4m3' cannot be read on cpu.*'int8', 'int4'"):
        hf_paged.PagedCache(model=paged, kv_format="fp8_e4m3")
    cache = paged_cache(paged, "fp8_e4m3")  # no model: the device is known at the first write
    with pytest.raises(CacheUsageError, match="kv_format='fp8_e4m3' cannot be read on cpu"):
        paged.generate(**left_padded_batch((5, 3)), **GEN, cache=cache)
    assert cache.get_seq_length() == 0 and cache.stats()["pages_used"] == 0
    calls = []
    handle = paged.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        with pytest.raises(CacheUsageError, match="kv_format='fp8_e4m3' cannot be read on cpu"):
            hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2, kv_format="fp8_e4m3", progress=False)
    finally:
        handle.remove()
    assert calls == []


@pytest.mark.parametrize("make", [lambda cfg, f: hf_paged.PagedCache(config=cfg, kv_format=f),
                                  lambda cfg, f: hf_paged.RaggedCache(cfg, kv_format=f)])
def test_bad_formats_are_refused_naming_the_argument_and_the_alternatives(make):
    config = make_config("llama")
    with pytest.raises(CacheUsageError, match=r"kv_format='int3' is not a page format; choose one of 'float', "):
        make(config, "int3")
    config.head_dim = 15
    with pytest.raises(CacheUsageError, match=r"kv_format='int4' packs 2 values a byte and needs a head_dim divisible"):
        make(config, "int4")
    config.head_dim = 18
    with pytest.raises(CacheUsageError, match=r"kv_format='int2' packs 4 .* head_dim divisible by 4, the model's is "
                                              r"18; choose one of 'float', 'int8', 'int4'$"):
        make(config, "int2")


@pytest.mark.parametrize("kv_format", FORMATS)
def test_a_run_of_quantized_pages_leaves_the_store_and_comes_back_byte_for_byte(kv_format):
    """What a prefix store outside the pool moves: each page's codes and scales as stored (decoding and encoding
    again would not give int4's bytes back), named by the store's page specs."""
    stores = [PageStore(page_size=2, kv_format=kv_format) for _ in range(2)]
    for store in stores:
        pages = store.create(0, torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16))
    stores[0].layers[0].grow_to(3)
    stores[0].layers[0].write(torch.arange(6), torch.randn(6, 2, 16), torch.randn(6, 2, 16))
    assert sorted(stores[0].page_specs([0])) == ["k_pool", "k_scale", "v_pool", "v_scale"]
    out = stores[0].read_pages(torch.tensor([2, 0]), [0])
    stores[1].write_pages(torch.tensor([1, 0]), [0], out, num_pages=3)
    for name, tensor in out.items():
        assert torch.equal(stores[1].read_pages(torch.tensor([1, 0]), [0])[name], tensor)
    keys, values = pages.gather(torch.tensor([1, 0]))
    want_keys, want_values = stores[0].layers[0].gather(torch.tensor([2, 0]))
    assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_int4_pages_go_through_a_disk_prefix_store_as_codes(tmp_path):
    """A fresh cache loads the full int4 pages a first cache wrote through to a disk store (codes and page
    parameters as stored: every full page was encoded from its exact keys) and generates what the first did."""
    _, paged = make_pair("llama")
    prompt = torch.randint(3, 96, (1, 22), generator=torch.Generator().manual_seed(4))  # 5 full pages of 4, then 2
    gen = dict(GEN, max_new_tokens=6)
    first = hf_paged.PagedCache(page_size=4, model=paged, kv_format="int4", prefix_store=str(tmp_path))
    want = paged.generate(prompt, attention_mask=torch.ones_like(prompt), **gen, cache=first)
    first.prefix_store.flush()
    again = hf_paged.PagedCache(page_size=4, model=paged, kv_format="int4", prefix_store=str(tmp_path))
    got = paged.generate(prompt, attention_mask=torch.ones_like(prompt), **gen, cache=again)
    assert again.stats()["store_hits"] == 5
    assert_same_run(got, want)


def test_generate_many_takes_the_format_of_a_given_cache_and_refuses_another():
    _, paged = shared_pair("llama")
    cache = hf_paged.RaggedCache(paged.config, page_size=4, kv_format="int8")
    with pytest.raises(CacheUsageError, match=r"kv_format='int4' with cache= \(whose kv_format is 'int8'\)"):
        hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2, cache=cache, kv_format="int4", progress=False)
    assert hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2, cache=cache, kv_format="int8",
                                  progress=False) == hf_paged.generate_many(paged, [[5, 6, 7]], max_new_tokens=2,
                                                                            kv_format="int8", progress=False)
