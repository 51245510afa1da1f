"""PagedCache API, interplay with other caches / attention implementations, and bad input."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from page_checks import check_pages
from tiny_models import left_padded_batch, make_pair

GEN = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def test_public_names():
    assert hf_paged.ATTN_IMPLEMENTATION == "hf_paged"
    assert issubclass(hf_paged.PagePoolExhausted, RuntimeError)
    stats = hf_paged.PagedCache().stats()
    for key in ("page_size", "pages_total", "pages_used", "pages_free", "pages_cached", "tokens_stored",
                "kv_bytes", "evictions", "prefix_hits"):
        assert key in stats


def test_stats_count_tokens_and_bytes(llama):
    ref, paged = llama
    batch = left_padded_batch((5, 9, 2))
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    paged.generate(**batch, **GEN, cache=cache)
    stats = cache.stats()
    tokens = 9 + GEN["max_new_tokens"] - 1
    assert stats["tokens_stored"] == 3 * tokens
    assert stats["pages_used"] == 3 * -(-tokens // 4)
    cfg = paged.config
    page_bytes = 2 * 4 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert stats["kv_bytes"] == stats["pages_used"] * page_bytes * cfg.num_hidden_layers
    assert stats["pages_total"] == stats["pages_used"] + stats["pages_free"] + stats["pages_cached"]
    check_pages(cache)


def test_reset_returns_every_page_and_cache_is_reusable(llama):
    ref, paged = llama
    batch = left_padded_batch((5, 9, 2))
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    first = paged.generate(**batch, **GEN, cache=cache)
    cache.reset()
    stats = cache.stats()
    assert stats["pages_used"] == 0 and cache.get_seq_length() == 0
    assert stats["pages_free"] + stats["pages_cached"] == stats["pages_total"] > 0
    other = left_padded_batch((3, 4), seed=5)
    want = ref.generate(**other, **GEN)
    assert torch.equal(paged.generate(**other, **GEN, cache=cache), want)
    cache.reset()
    assert torch.equal(paged.generate(**batch, **GEN, cache=cache), first)


def test_pool_allocated_lazily_on_first_key_dtype_and_device():
    _, paged = make_pair("llama")
    cache = hf_paged.PagedCache(page_size=8)
    assert cache.stats()["kv_bytes"] == 0 and len(cache.layers) == 0
    paged.to(torch.bfloat16).generate(**left_padded_batch((3, 4)), **GEN, cache=cache)
    assert all(layer.pages.dtype == torch.bfloat16 and layer.pages.device.type == "cpu" for layer in cache.layers)
    assert cache.layers[0].pages.keys.shape[1:] == (8, 2, 16)


def test_hf_paged_model_without_cache_and_with_dynamic_cache(llama):
    ref, paged = llama
    batch = left_padded_batch((7, 4, 10))
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    want = ref(**batch, labels=labels, use_cache=False)
    got = paged(**batch, labels=labels, use_cache=False)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    want_ids = ref.generate(**batch, **GEN, cache=DynamicCache(config=ref.config))
    assert torch.equal(paged.generate(**batch, **GEN, cache=DynamicCache(config=paged.config)), want_ids)


def test_paged_cache_with_stock_attention_is_correct(llama):
    ref, _ = llama  # sdpa model reading a PagedCache: pages are materialised, output stays exact
    batch = left_padded_batch((6, 3, 8))
    want = ref.generate(**batch, **GEN, cache=DynamicCache(config=ref.config))
    got = ref.generate(**batch, **GEN, cache=hf_paged.PagedCache(page_size=3, config=ref.config))
    assert torch.equal(got, want)


def test_stock_attention_warns_once_per_process():
    """PagedCache(config=...) of an sdpa model, then its steps, in two generate calls: one warning in all
    (a fresh process: the warning is once per process)."""
    code = (
        "import hf_paged\n"
        "from tiny_models import left_padded_batch, make_pair\n"
        "ref, _ = make_pair('llama')\n"
        "for _ in range(2):\n"
        "    cache = hf_paged.PagedCache(page_size=3, config=ref.config)\n"
        f"    ref.generate(**left_padded_batch((6, 3)), **{GEN!r}, cache=cache)\n"
        "print('generated', cache.get_seq_length())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parent,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 15" in proc.stdout
    assert proc.stderr.count("attn_implementation='hf_paged'") == 1, proc.stderr[-3000:]


# ------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("value", [0, -3, 1.5, True, "16", None])
def test_bad_page_size(value):
    with pytest.raises(hf_paged.CacheUsageError, match="page_size"):
        hf_paged.PagedCache(page_size=value)


@pytest.mark.parametrize("value", [0, -1, 2.0, False])
def test_bad_max_pages(value):
    with pytest.raises(hf_paged.CacheUsageError, match="max_pages"):
        hf_paged.PagedCache(max_pages=value)


def test_max_pages_below_one_page_per_row(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=4, max_pages=2, config=paged.config)
    with pytest.raises(hf_paged.CacheUsageError, match="max_pages=2 is smaller than one page per row"):
        paged.generate(**left_padded_batch((3, 5, 4)), **GEN, cache=cache)
    check_pages(cache)
    assert cache.get_seq_length() == 0
    batch = left_padded_batch((3,))
    assert torch.equal(paged.generate(**batch, max_new_tokens=4, pad_token_id=0, eos_token_id=None, cache=cache),
                       paged.generate(**batch, max_new_tokens=4, pad_token_id=0, eos_token_id=None))


def test_bounded_pool_exhausted_keeps_cache_consistent(llama):
    ref, paged = llama
    batch = left_padded_batch((6, 4))
    cache = hf_paged.PagedCache(page_size=4, max_pages=4, config=paged.config, eviction="error")
    with pytest.raises(hf_paged.PagePoolExhausted) as info:
        paged.generate(**batch, max_new_tokens=12, pad_token_id=0, eos_token_id=None, cache=cache)
    assert info.value.needed > info.value.available
    assert "max_pages=4" in str(info.value) and "eviction" in str(info.value)
    # the failing step changed nothing: 8 tokens per row were cached before it (2 pages each)
    assert cache.get_seq_length() == 8
    assert cache.stats()["tokens_stored"] == 16
    check_pages(cache)
    # the cached tokens are intact: drop the 2 generated ones and continue the prompt like DynamicCache
    cache.crop(-2)
    dyn = DynamicCache(config=ref.config)
    ref.generate(**batch, max_new_tokens=3, pad_token_id=0, eos_token_id=None, cache=dyn)
    dyn.crop(-2)
    x = torch.tensor([[5], [7]])
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 1, dtype=torch.long)], dim=1)
    want = ref(input_ids=x, attention_mask=mask, cache=dyn).logits
    got = paged(input_ids=x, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_batch_size_change_on_non_empty_cache(llama):
    ref, paged = llama
    batch = left_padded_batch((6, 4, 5))
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    paged.generate(**batch, **GEN, cache=cache)
    before = cache.stats()
    with pytest.raises(hf_paged.CacheUsageError, match="batch size changed from 3 to 2"):
        paged.generate(**left_padded_batch((30, 28)), **GEN, cache=cache)
    assert cache.stats() == before
    check_pages(cache)


@pytest.mark.parametrize("bad", ["heads", "head_dim", "dtype", "device"])
def test_mismatched_keys_and_values(bad):
    cache = hf_paged.PagedCache(page_size=4)
    k = torch.randn(2, 2, 3, 8)
    for layer in range(2):
        cache.update(k, k.clone(), layer)
    before = (cache.get_seq_length(), cache.stats())
    new = torch.randn(2, 2, 1, 8)
    wrong = {"heads": torch.randn(2, 3, 1, 8), "head_dim": torch.randn(2, 2, 1, 4),
             "dtype": new.to(torch.float64), "device": new.to("meta")}[bad]
    # the first layer of the step accepts; the second gets wrong keys: the whole step is undone
    cache.update(new, new.clone(), 0)
    with pytest.raises(hf_paged.CacheUsageError, match=r"layer 1: .*pool has"):
        cache.update(wrong, wrong.clone() if bad != "device" else wrong, 1)
    assert (cache.get_seq_length(), cache.stats()) == before
    check_pages(cache)
    # and the cache still works: the next step is accepted by every layer
    for layer in range(2):
        cache.update(new, new.clone(), layer)
    assert cache.get_seq_length() == 4
    keys, _ = cache.layers[1].read()
    torch.testing.assert_close(keys[:, :3].transpose(1, 2), k)
    torch.testing.assert_close(keys[:, 3:].transpose(1, 2), new)
