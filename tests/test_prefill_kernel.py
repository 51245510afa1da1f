"""The C prefill kernel (`cpu_paged_attention.prefill_attention_cpu`, `hf_paged.prefill_kernel`): a packed step's
prefill chunks over their pages, against the float64 reference and the per-segment path it replaces."""

import pytest
import torch
import torch.nn.functional as F

import hf_paged
from hf_paged.attention import packed_attention
from hf_paged.kernels.cpu_paged_attention import prefill_attention_cpu
from hf_paged.kv_formats import dequantize, page_format, quantize
from test_shared_prefix import NEVER, attend_layer0, make_cache, set_threshold, share
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def constructed(S, Hq, Hkv, D, spans, dtype=torch.float32, seed=0):
    """Pools of random pages in ``dtype``, a strided float32 query, and the index of segments ``spans`` ((past,
    length) each) whose tables take distinct pages in a random order."""
    g = torch.Generator().manual_seed(seed)
    P = sum((p + n + S - 1) // S for p, n in spans) + 3
    k_pool, v_pool = (torch.randn(P, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
    T = sum(n for _, n in spans)
    query = torch.randn(Hq, T, D, generator=g).transpose(0, 1)  # [T, Hq, D], not contiguous
    width = max((p + n + S - 1) // S for p, n in spans)
    order = torch.randperm(P, generator=g)
    table = torch.zeros(len(spans), width, dtype=torch.long)
    segments, start, used = [], 0, 0
    for i, (past, n) in enumerate(spans):
        pages = (past + n + S - 1) // S
        table[i, :pages] = order[used:used + pages]
        used += pages
        segments.append((start, n, past))
        start += n
    return query, k_pool, v_pool, table, torch.tensor(segments)


def reference(query, k_pool, v_pool, table, segments, scale):
    """float64 causal attention of each segment's queries over its table's tokens."""
    Hq, Hkv = query.shape[1], k_pool.shape[2]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for pages, (start, n, past) in zip(table, segments.tolist()):
        k, v = (pool[pages].flatten(0, 1)[:past + n].double().transpose(0, 1).repeat_interleave(Hq // Hkv, 0)
                for pool in (k_pool, v_pool))
        mask = torch.arange(past + n)[None] <= torch.arange(past, past + n)[:, None]
        q = query[start:start + n].double().transpose(0, 1)
        out[start:start + n] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)
    return out


CASES = [  # (page size, query heads, KV heads, head dim, (past, length) of each segment, pool dtype)
    (16, 9, 3, 64, [(512, 140), (0, 33), (7, 2), (100, 40)], torch.float32),  # SmolLM2's shapes, a shared prefix
    (1, 4, 2, 16, [(5, 3), (0, 9)], torch.float32),  # one-token pages
    (32, 8, 8, 80, [(40, 50)], torch.float32),  # no GQA, a head dim of 64 + 16
    (4, 4, 1, 128, [(0, 100), (300, 17)], torch.float32),  # MQA, two blocks of 64 lanes
    (16, 6, 2, 32, [(3, 70), (0, 2)], torch.bfloat16),
    (16, 6, 2, 192, [(3, 70)], torch.float32),
]


@pytest.mark.parametrize("S,Hq,Hkv,D,spans,dtype", CASES)
def test_the_kernel_equals_the_float64_reference(S, Hq, Hkv, D, spans, dtype):
    args = constructed(S, Hq, Hkv, D, spans, dtype)
    out = prefill_attention_cpu(*args, D ** -0.5)
    torch.testing.assert_close(out.double(), reference(*args, D ** -0.5), rtol=1e-5, atol=2e-6)


def quantized_pages(kv_format, k_pool, v_pool):
    """Float pools as pages of ``kv_format`` by its codecs (int4 / int2 keys encoded over each whole page, values
    rotated): the kernel's arguments ``(k_codes, v_codes, k_scale, v_scale)``, and what the pages hold (dequantized
    keys and values, float32)."""
    fmt = page_format(kv_format)
    if getattr(fmt.key, "per_page", False):
        k_codes, k_scale = fmt.key.encode_pages(k_pool.float(), torch.ones(k_pool.shape[:2], dtype=torch.bool))
        keys = fmt.key.decode_pages(k_codes, k_scale, k_pool.shape[-1])
    else:
        k_codes, k_scale = quantize(fmt.key, k_pool)
        keys = dequantize(fmt.key, k_codes, k_scale, k_pool.shape[-1])
    v_codes, v_scale = quantize(fmt.value, v_pool)
    values = dequantize(fmt.value, v_codes, v_scale, v_pool.shape[-1])
    return (k_codes, v_codes, k_scale, v_scale), keys, values


@pytest.mark.parametrize("kv_format", ["int8", "int4", "int2"])
@pytest.mark.parametrize("S,Hq,Hkv,D,spans,_", [CASES[0], CASES[1], CASES[3]])
def test_quantized_pages_equal_the_float64_reference_of_what_they_hold(S, Hq, Hkv, D, spans, _, kv_format):
    query, k_pool, v_pool, table, segments = constructed(S, Hq, Hkv, D, spans)
    (k_codes, v_codes, k_scale, v_scale), keys, values = quantized_pages(kv_format, k_pool, v_pool)
    out = prefill_attention_cpu(query, k_codes, v_codes, table, segments, D ** -0.5, k_scale, v_scale, kv_format)
    want = reference(query, keys, values, table, segments, D ** -0.5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert (want - reference(query, k_pool, v_pool, table, segments, D ** -0.5)).abs().max() > 1e-4  # (quantized)


def test_quantized_pools_need_their_format_and_scales():
    query, k_pool, v_pool, table, segments = constructed(4, 4, 2, 16, [(3, 5)])
    (k_codes, v_codes, k_scale, v_scale), _, _ = quantized_pages("int8", k_pool, v_pool)
    with pytest.raises(ValueError, match="float32 or bfloat16 pools of one dtype, or int8, int4 or int2 pages"):
        prefill_attention_cpu(query, k_codes, v_codes, table, segments, 0.25)  # (kv_format="float")
    with pytest.raises(ValueError, match="v_scale of kv_format='int8' must be torch.float16"):
        prefill_attention_cpu(query, k_codes, v_codes, table, segments, 0.25, k_scale, v_scale.float(), "int8")
    with pytest.raises(ValueError, match="k_scale of kv_format='int8' must be torch.float16"):
        prefill_attention_cpu(query, k_codes, v_codes, table, segments, 0.25, k_scale[:-1], v_scale, "int8")
    with pytest.raises(ValueError, match="k_scale/v_scale belong to quantized pools"):
        prefill_attention_cpu(query, k_pool, v_pool, table, segments, 0.25, k_scale, v_scale)
    with pytest.raises(ValueError, match="k_pool of kv_format='int4' must be torch.uint8"):
        prefill_attention_cpu(query, k_codes, v_codes, table, segments, 0.25, k_scale, v_scale, "int4")


def test_a_query_never_reads_keys_after_its_position_or_past_the_sequence():
    """Later tokens' keys and values changed, and garbage (NaN) in the unused slots of the last pages: the earlier
    queries' outputs stay the same, bit for bit, and nothing is NaN."""
    query, k_pool, v_pool, table, segments = constructed(16, 4, 2, 32, [(20, 30), (0, 7)])
    before = prefill_attention_cpu(query, k_pool, v_pool, table, segments, 0.2)
    for (start, n, past), pages in zip(segments.tolist(), table):
        pages = pages[:(past + n + 15) // 16]  # (the rest of the row is padding)
        for pool in (k_pool, v_pool):
            tokens = pool[pages].flatten(0, 1)  # a copy: written back below
            tokens[past + n - 3:past + n] = 7.0  # the segment's last 3 tokens change
            tokens[past + n:] = float("nan")  # never written: may hold anything
            pool[pages] = tokens.view(len(pages), 16, *pool.shape[2:])
    after = prefill_attention_cpu(query, k_pool, v_pool, table, segments, 0.2)
    assert not after.isnan().any()
    for start, n, _ in segments.tolist():
        assert torch.equal(after[start:start + n - 3], before[start:start + n - 3])  # the queries before them
        assert not torch.equal(after[start + n - 3:start + n], before[start + n - 3:start + n])


def test_a_bad_index_is_refused_with_what_was_wrong():
    query, k_pool, v_pool, table, segments = constructed(4, 4, 2, 16, [(3, 5)])
    bad = table.clone()
    bad[0, 0] = k_pool.shape[0]
    with pytest.raises(ValueError, match=r"page ids must lie in \[0, "):
        prefill_attention_cpu(query, k_pool, v_pool, bad, segments, 0.25)
    with pytest.raises(ValueError, match="within their table"):
        prefill_attention_cpu(query, k_pool, v_pool, table, torch.tensor([[0, 5, 30]]), 0.25)
    with pytest.raises(ValueError, match="float32 query"):
        prefill_attention_cpu(query.double(), k_pool, v_pool, table, segments, 0.25)
    with pytest.raises(ValueError, match="contiguous int64 table"):
        prefill_attention_cpu(query, k_pool, v_pool, table.int(), segments, 0.25)
    prefill_attention_cpu(query, k_pool, v_pool, table, segments, 0.25)  # a good call, then the same table again
    with pytest.raises(ValueError, match="within their table"):  # with segments past it: checked again
        prefill_attention_cpu(query, k_pool, v_pool, table, torch.tensor([[0, 5, 30]]), 0.25)


@pytest.mark.parametrize("kv_format,dtype", [("float", torch.float32), ("float", torch.bfloat16),
                                             ("int8", torch.float32), ("int4", torch.float32), ("int2", torch.float32)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_a_packed_step_equals_the_per_segment_path(monkeypatch, page_size, kv_format, dtype):
    """Decode rows and prefill chunks in one step (sharers of a cached prefix, one continuing an earlier chunk, a
    fresh prompt): the step's attention with the prefill kernel equals the per-segment path's."""
    cache = make_cache(page_size=page_size, kv_format=kv_format)
    for seq_id in (0, 8):
        cache.add_sequence(seq_id)
    attend_layer0(cache, [[(0, 4 * page_size + 3), (8, 10)]], dtype=dtype)
    cache.finish_step()
    share(cache, 0, [1, 2, 4], 4 * page_size)
    cache.add_sequence(5)
    attend_layer0(cache, [[(4, 5)]], dtype=dtype)
    cache.finish_step()
    view, q = attend_layer0(cache, [[(0, 1), (8, 1), (1, 9), (2, 2), (4, 6), (5, 8)]], dtype=dtype)
    calls = []
    kernel = hf_paged.attention.prefill_kernel_attention
    monkeypatch.setattr(hf_paged.attention, "prefill_kernel_attention", lambda *a: calls.append(1) or kernel(*a))
    set_threshold(monkeypatch, NEVER)
    new = packed_attention(q, view, 0.25, None, None, None)
    monkeypatch.setattr(hf_paged.attention, "prefill_kernel_applies", lambda *args: False)
    old = packed_attention(q, view, 0.25, None, None, None)
    assert calls == [1] and new.dtype == old.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 outputs: rounded once either way
    torch.testing.assert_close(new, old, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3"])  # gemma3: sliding-window layers keep SDPA
def test_generate_with_a_paged_cache_prefills_rows_in_the_kernel_and_equals_dynamic_cache(monkeypatch, name):
    """A batch of two unpadded prompts: the prompt's step runs in the prefill kernel (no mask to apply); its
    logits match `DynamicCache`'s and the greedy tokens are identical. A padded batch keeps the masked path."""
    ref, paged = make_pair(name)
    calls = []
    rows = hf_paged.attention.rows_prefill_attention
    monkeypatch.setattr(hf_paged.attention, "rows_prefill_attention", lambda *a: calls.append(1) or rows(*a))
    ids = torch.randint(1, 96, (2, 21), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = ref(ids).logits
        got = paged(ids, **{hf_paged.CACHE_KWARG: hf_paged.PagedCache(page_size=4, config=paged.config)}).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert calls and len(calls) <= paged.config.num_hidden_layers
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cache = lambda: {hf_paged.CACHE_KWARG: hf_paged.PagedCache(page_size=4, config=paged.config)}  # noqa: E731
    assert torch.equal(paged.generate(ids, **cache(), **kwargs), ref.generate(ids, **kwargs))
    calls.clear()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    paged.generate(ids, attention_mask=mask, **cache(), **kwargs)
    assert not calls


def test_threads_split_the_work_items_and_give_the_same_result():
    """(chunk, KV head) items shared by two threads: the same output as one thread's, bit for bit."""
    args = constructed(16, 9, 3, 64, [(100, 60), (0, 45), (30, 9)])
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(prefill_attention_cpu(*args, 0.125))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("kv_format", ["int8", "int4"])
def test_generate_with_quantized_pages_prefills_rows_in_the_kernel_as_the_sdpa_path_does(monkeypatch, kv_format):
    """A `PagedCache(kv_format=...)`'s prompt step runs in the prefill kernel over the quantized pages: its logits
    equal those of the path it replaces (SDPA over the dequantized pages) within float rounding, and so do the
    greedy tokens."""
    _, paged = make_pair("llama")
    calls = []
    rows = hf_paged.attention.rows_prefill_attention
    monkeypatch.setattr(hf_paged.attention, "rows_prefill_attention", lambda *a: calls.append(1) or rows(*a))
    ids = torch.randint(1, 96, (2, 21), generator=torch.Generator().manual_seed(6))
    cache = lambda: {hf_paged.CACHE_KWARG: hf_paged.PagedCache(page_size=4, kv_format=kv_format,  # noqa: E731
                                                               config=paged.config)}
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = paged(ids, **cache()).logits
        tokens = paged.generate(ids, **cache(), **kwargs)
        assert calls
        monkeypatch.setattr(hf_paged.attention, "rows_kernel_applies", lambda *a: False)
        want = paged(ids, **cache()).logits
        assert torch.equal(paged.generate(ids, **cache(), **kwargs), tokens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
