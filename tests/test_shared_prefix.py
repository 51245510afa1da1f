"""Cascade attention over a shared prefix (`hf_paged.shared_prefix`) against the per-segment path it replaces, on
constructed packed steps, and generate_many's greedy tokens against per-prompt `generate` when it runs. Prefill
chunks on float pages take the C prefill kernel first (`hf_paged.prefill_kernel`, tests/test_prefill_kernel.py):
these tests turn it off (`without_prefill_kernel`) to reach the cascade of chunks, as quantized pages do."""

import importlib.util
from pathlib import Path

import pytest
import torch

import hf_paged
from hf_paged import shared_prefix
from hf_paged.attention import packed_attention
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import generate_each, random_prompts
from tiny_models import make_config, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[1]
NEVER = 10**9  # a threshold no prefix reaches: the per-segment path


@pytest.fixture
def without_prefill_kernel(monkeypatch):
    """Prefill chunks take the cascade or the per-segment path, as when the C prefill kernel does not apply."""
    monkeypatch.setattr(hf_paged.attention, "prefill_kernel_applies", lambda *args: False)


def attend_layer0(cache, steps, seed=0, dtype=torch.float32):
    """Run ``steps`` (lists of (seq_id, n), one-token segments first) on layer 0 with random queries, keys and values;
    returns the last step's view and queries (its step still planned)."""
    config = CONFIG
    Hq, Hkv = config.num_attention_heads, config.num_key_value_heads
    D = getattr(config, "head_dim", None) or config.hidden_size // Hq
    g = torch.Generator().manual_seed(seed)
    layer = cache.layers[0]
    for i, step in enumerate(steps):
        cache.begin_step(step)
        T = sum(n for _, n in step)
        q, k, v = (torch.randn(1, h, T, D, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
        view = layer._write(k, v)
        if i < len(steps) - 1:
            cache.finish_step()
    return view, q


def set_threshold(monkeypatch, min_tokens):
    """Groups from ``min_tokens`` shared tokens and two rows on."""
    for name in ("PREFILL_MIN_TOKENS", "DECODE_MIN_TOKENS"):
        monkeypatch.setattr(shared_prefix, name, min_tokens)
    monkeypatch.setattr(shared_prefix, "DECODE_MIN_ROW_TOKENS", 2 * min_tokens)


def both_paths(monkeypatch, view, q, min_tokens):
    """(per-segment output, cascade output, the cascade's groups)."""
    outs = {}
    for threshold in (NEVER, min_tokens):
        set_threshold(monkeypatch, threshold)
        outs[threshold] = packed_attention(q, view, 0.25, None, None, None)
    return outs[NEVER], outs[min_tokens], shared_prefix.shared_prefix_groups(view.plan)


CONFIG = make_config("llama")  # GQA: 4 query heads, 2 KV heads


def make_cache(page_size=4, kv_format="float"):
    return RaggedCache(CONFIG, page_size=page_size, kv_format=kv_format)


def share(cache, source, seq_ids, tokens):
    for seq_id in seq_ids:
        cache.add_sequence(seq_id, cache.sequences[source].pages[:tokens // cache.page_size], tokens)


@pytest.mark.parametrize("interleaved", [False, True])  # True: the prefix's page ids are not consecutive (gathered)
@pytest.mark.parametrize("kv_format,dtype", [("float", torch.float32), ("float", torch.bfloat16),
                                             ("int8", torch.float32)])  # int8: own tokens read from the pages
@pytest.mark.parametrize("page_size", [4, 16])
def test_rows_over_a_shared_prefix_equal_the_per_segment_path(monkeypatch, without_prefill_kernel, kv_format, dtype,
                                                              page_size, interleaved):
    """Decode rows and prefill chunks mixed in one step: sharers of different own lengths, one continuing an earlier
    chunk, decode rows with and without the prefix, a chunk of a sequence of its own and a fresh prompt."""
    cache = make_cache(page_size=page_size, kv_format=kv_format)
    prefix = 4 * page_size
    for seq_id in (0, 8, 9):
        cache.add_sequence(seq_id)
    if interleaved:
        attend_layer0(cache, [[(0, page_size), (9, page_size + 1)]], dtype=dtype)
        cache.finish_step()
        attend_layer0(cache, [[(0, prefix - page_size + 3), (8, 10)]], dtype=dtype)
    else:
        attend_layer0(cache, [[(0, prefix + 3), (9, page_size + 1), (8, 10)]], dtype=dtype)
    cache.finish_step()
    pages = cache.sequences[0].pages[:4]
    assert (pages == list(range(pages[0], pages[0] + 4))) != interleaved
    share(cache, 0, [1, 2, 3, 4, 6], prefix)
    cache.add_sequence(5)  # a fresh prompt: no past
    attend_layer0(cache, [[(4, 5)]], dtype=dtype)  # sequence 4's first own chunk: its next one continues after it
    cache.finish_step()
    view, q = attend_layer0(cache, [[(0, 1), (6, 1), (8, 1), (1, 9), (9, 6), (2, 2), (3, 13), (4, 6), (5, 8)]],
                            dtype=dtype)
    old, new, groups = both_paths(monkeypatch, view, q, page_size)
    assert groups == [(4, [3, 5, 6, 7])]  # segment indices: the chunks of sequences 1, 2, 3, 4
    decode = kv_format == "float"  # (the C kernel's log-sum-exp: float pages)
    assert shared_prefix.shared_prefix_groups(view.plan, decode=True) == [(4, [0, 1])]  # sequences 0 and 6
    assert decode == shared_prefix.decode_cascade_applies(view)
    assert new.dtype == old.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bfloat16 outputs: rounded once either way
    torch.testing.assert_close(new, old, rtol=tolerance, atol=tolerance)


def prefix_of(tokens):
    """A cache of pages of 4 whose sequence 0 holds ``tokens``, shared by sequences 1 and 2 (their first 16)."""
    cache = make_cache()
    cache.add_sequence(0)
    attend_layer0(cache, [[(0, tokens)]])
    cache.finish_step()
    share(cache, 0, [1, 2], 16)
    return cache


def test_groups_need_two_chunks_pages_in_their_past_and_the_threshold(monkeypatch, without_prefill_kernel):
    cache = prefix_of(19)
    cache.add_sequence(3, cache.sequences[0].pages[:2], 8)  # a shorter share of the same first pages
    view, q = attend_layer0(cache, [[(1, 4), (2, 3), (3, 5)]])
    old, new, groups = both_paths(monkeypatch, view, q, 4)
    assert groups == [(2, [0, 1, 2])]  # what all three share: 2 pages
    torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-5)
    set_threshold(monkeypatch, 20)
    assert shared_prefix.shared_prefix_groups(view.plan) == []  # no chunk has 20 tokens in its past


def test_a_wrong_merge_is_caught(monkeypatch, without_prefill_kernel):
    """The comparison above can fail: dropping the own part's weight changes the output."""
    view, q = attend_layer0(prefix_of(17), [[(1, 4), (2, 3)]])
    monkeypatch.setattr(torch, "sigmoid", lambda x: torch.full_like(x, 0.5))
    old, new, groups = both_paths(monkeypatch, view, q, 4)
    assert groups and not torch.allclose(new, old, rtol=1e-5, atol=1e-5)


SHARED_NEW = (6, 3, 9, 4, 7)


@pytest.mark.parametrize("prefill_kernel", [False, True])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma2", "gemma3", "gpt_oss"])  # softcap, windows, sinks
def test_greedy_tokens_with_a_shared_system_prompt_equal_generate(monkeypatch, name, prefill_kernel):
    """Chunks through the cascade (the prefill kernel off) or the C prefill kernel, where either applies."""
    set_threshold(monkeypatch, 8)
    calls = []
    name_of_path = "prefill_kernel_attention" if prefill_kernel else "cascade_attention"
    path = getattr(hf_paged.attention, name_of_path)
    monkeypatch.setattr(hf_paged.attention, name_of_path, lambda *a: calls.append(1) or path(*a))
    if not prefill_kernel:
        monkeypatch.setattr(hf_paged.attention, "prefill_kernel_applies", lambda *args: False)
    ref, paged = make_pair(name)
    system = random_prompts((24,), seed=3)[0]
    prompts = [system + p for p in random_prompts((5, 9, 2, 13, 7), seed=4)]
    want = generate_each(ref, prompts, SHARED_NEW, eos_token_id=None)
    got = hf_paged.generate_many(paged, prompts, max_new_tokens=list(SHARED_NEW), page_size=4, max_batch_tokens=256,
                                 eos_token_id=[], progress=False)
    assert got == want
    assert bool(calls) == (name in ("llama", "qwen3", "gemma3"))  # not with a softcap or sinks


def test_the_benchmark_script_measures_both_paths_and_they_agree(tmp_path):
    """scripts/shared_prefix_bench.py on a small sweep: every row measured, the two paths' outputs equal."""
    spec = importlib.util.spec_from_file_location("shared_prefix_bench", ROOT / "scripts" / "shared_prefix_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(bench.parse_args(["--prefixes", "32", "--rows", "2", "--chunks", "2", "--own", "20,9",
                                        "--generated", "1", "--repeats", "2", "--out", str(tmp_path)]))
    assert [(r["step"], r["rows"]) for r in rows] == [("prefill", 2), ("decode", 2)]
    assert all(r["max_abs_diff"] < 1e-5 and r["per_row_ms"] > 0 and r["cascade_ms"] > 0 for r in rows)
    assert (tmp_path / "shared_prefix.md").read_text().count("\n| ") == 3  # header and two rows
    assert shared_prefix.PREFILL_MIN_TOKENS == 512  # the thresholds are restored
