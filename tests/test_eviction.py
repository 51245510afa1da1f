"""Bounded pools: eviction order per policy, protected pages, exactness within budget, soak."""

import gc
import math
import logging

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.block_manager import EVICTED
from hf_paged import attention
from hf_paged.errors import CacheUsageError
from hf_paged.eviction import DEFAULT_INTERVAL, EvictionPolicy, PageHistory, page_usage
from hf_paged.kernels import cpu_paged_attention as cpu_kernel
from hf_paged.kernels.reference import paged_attention_reference
from page_checks import check_pages
from tiny_models import left_padded_batch, make_pair

GEN = dict(pad_token_id=0, eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def most_pages_held(cache) -> int:
    """The most pages any layer group holds (each group is bounded by max_pages on its own)."""
    cache.commit()
    return max(g.manager.num_used for g in cache.groups.values())


def _usage(policy: EvictionPolicy, pages: list[int], steps: list[list[float]]) -> PageHistory:
    """``policy``'s record of ``steps`` of attention mass over ``pages`` (one row)."""
    usage = PageHistory()
    usage.allocated(pages, 0)
    for step, mass in enumerate(steps, start=1):
        policy.record(usage, torch.tensor([pages]), torch.tensor([mass]), step)
    return usage


@pytest.mark.parametrize("holes", [False, True])
def test_a_no_decay_score_records_each_page_s_share_of_its_row(holes):
    """A no-decay "score" (TOVA) records a step's attention as each live page's mass over an even share of its
    row (0 for a row that attends nothing, or whose mass is not a number; inf at holes), and that share is the
    page's score from then on. A table without holes is recorded in one pass over its rows, one with holes row by
    row: the same numbers."""
    tova = EvictionPolicy.for_pages(1)
    pages = torch.tensor([[3, 1, 2, 0], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
    if holes:
        pages[0, 1] = pages[2, 3] = EVICTED
    mass = torch.tensor([[0.1, 0.7, 0.15, 0.05], [0.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.2, 0.2],
                         [0.5, math.nan, 0.2, 0.3]]) * (pages >= 0)
    usage = PageHistory()
    usage.allocated(pages[pages >= 0], 0)
    shares = tova.record(usage, pages, mass, 1)
    for row_pages, row_mass, row_shares in zip(pages.tolist(), mass.double().tolist(), shares.tolist()):
        live = [m for p, m in zip(row_pages, row_mass) if p != EVICTED]
        even = sum(live) / len(live)
        want = [math.inf if p == EVICTED else m / even if even > 0 else 0.0 for p, m in zip(row_pages, row_mass)]
        assert row_shares == pytest.approx(want, rel=1e-15)
        ids = [p for p in row_pages if p != EVICTED]
        assert tova.scores(usage, ids).tolist() == [s for p, s in zip(row_pages, row_shares) if p != EVICTED]


def _usage_of(signal: str, page_size: int, probs, values, out) -> torch.Tensor:
    """What the torch path reports per page for ``probs [B, Hkv, g, Q, T]``, ``values [B, T, Hkv, D]`` and
    ``out [B, Q, Hq, D]``."""
    return page_usage(probs, out, values, page_size, signal)


@pytest.mark.parametrize("page_size", [1, 4])
def test_output_signal_of_the_torch_path_matches_the_reference(page_size):
    """The live-page path (torch, Triton's and pages of several tokens) measures what the reference defines:
    attention mass, or how far dropping each page moves each head's output (GQA, 3 queries, rows reaching
    different lengths)."""
    g = torch.Generator().manual_seed(page_size)
    B, Hq, Hkv, Q, D, N, S = 2, 6, 2, 3, 16, 10, page_size
    q, k, v = (torch.randn(shape, generator=g) for shape in ((B, Hq, Q, D), (N, S, Hkv, D), (N, S, Hkv, D)))
    table = torch.arange(N).expand(B, N).contiguous()
    q_pos = torch.tensor([[N * S - 3, N * S - 2, N * S - 1], [N * S - 8, N * S - 7, N * S - 6]])
    keys = k.reshape(1, N * S, Hkv, D).expand(B, -1, -1, -1)
    values = v.reshape(1, N * S, Hkv, D).expand(B, -1, -1, -1)
    mask = torch.arange(N * S)[None, None, None, :] <= q_pos[:, None, :, None]
    out, probs = attention.attend(q, keys.transpose(1, 2), values.transpose(1, 2), mask, 0.25, return_probs=True)
    for signal in ("attention", "output"):
        _, want = paged_attention_reference(q, k, v, table, table * S, q_pos, scale=0.25, return_page_mass=True,
                                            page_mass_signal=signal)
        torch.testing.assert_close(_usage_of(signal, S, probs, values, out), want, rtol=1e-4, atol=1e-6)


def test_output_signal_lets_a_redundant_page_go_before_a_less_attended_distinct_one():
    """Three one-token pages attended 0.6 / 0.3 / 0.1, the first two holding the same value: dropping the second
    barely moves the output, so the output signal ranks it lowest, where attention ranks the third lowest."""
    probs = torch.tensor([0.6, 0.3, 0.1]).reshape(1, 1, 1, 1, 3)
    values = torch.tensor([[1.0, 0.0], [1.0, 0.0], [-5.0, 0.0]]).reshape(1, 3, 1, 2)
    out = (probs.reshape(3, 1) * values.reshape(3, 2)).sum(0).reshape(1, 1, 1, 2)
    assert _usage_of("attention", 1, probs, values, out).argmin().item() == 2
    moved = _usage_of("output", 1, probs, values, out)
    assert moved.argmin().item() == 1
    torch.testing.assert_close(moved, torch.tensor([[[0.6 / 0.4 * 0.6, 0.3 / 0.7 * 0.6, 0.1 / 0.9 * 5.4]]]))


@pytest.mark.parametrize("signal", ["output", "attention"])
def test_the_c_kernel_and_the_torch_path_evict_alike(llama, signal):
    """A bounded cache of one-token pages generates the same tokens and keeps the same pages with the usage
    measured by the C kernel as by the torch path."""
    if cpu_kernel.unavailable_reason() is not None:
        pytest.skip(cpu_kernel.unavailable_reason())
    _, paged = llama
    prompt = torch.randint(3, 96, (2, 20), generator=torch.Generator().manual_seed(4))
    runs = {}
    for backend in ("cpu", "torch"):
        cache = hf_paged.PagedCache(page_size=1, max_pages=24, config=paged.config, backend=backend,
                                    compress_prompt=True, score_signal=signal)
        out = paged.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, **GEN,
                             cache=cache)
        cache.commit()
        runs[backend] = out, {w: [list(r) for r in g.rows] for w, g in cache.groups.items()}, cache.stats()["evictions"]
    assert runs["cpu"][2] > 100  # every layer evicts
    assert torch.equal(runs["cpu"][0], runs["torch"][0])
    assert runs["cpu"][1] == runs["torch"][1]


@pytest.mark.parametrize("name", ["score", "lru"])
def test_a_page_that_keeps_being_attended_survives(name):
    policy = EvictionPolicy(name, sink_pages=1, recent_pages=1)
    row = [10, 11, 12, 13, 14]
    # page 11 is attended at every step; page 12 never; 13 only at the first step; 10 is a sink, 14 the newest
    steps = [[0.4, 0.2, 0.0, 0.2, 0.2]] + [[0.5, 0.25, 0.0, 0.0, 0.25]] * 5
    usage = _usage(policy, row, steps)
    assert policy.victim(row, 0, usage) == 2  # 12: never attended
    row[2] = EVICTED
    assert policy.victim(row, 0, usage) == 3  # 13: not attended since the first step
    row[3] = EVICTED
    assert policy.victim(row, 0, usage) == 1  # only 11 is left unprotected
    assert policy.victim([10, EVICTED, 14], 0, usage) is None


def test_score_decays_old_attention_and_is_not_biased_by_age():
    policy = EvictionPolicy("score", sink_pages=0, recent_pages=1, decay=0.5)
    # page 20 was heavily attended long ago, page 21 moderately now; page 22 arrives late, attended as much as 21
    usage = _usage(policy, [20, 21], [[1.0, 0.0]] * 3 + [[0.1, 0.9]] * 4)
    usage.allocated([22, 23], 8)
    for step in range(8, 10):
        policy.record(usage, torch.tensor([[20, 21, 22, 23]]), torch.tensor([[0.1, 0.4, 0.4, 0.1]]), step)
    assert policy.victim([20, 21, 22, 23], 0, usage) == 0  # the old heavy hitter faded
    newcomer, veteran = policy.scores(usage, torch.tensor([22, 21])).tolist()
    assert newcomer == pytest.approx(veteran, rel=0.2)  # newcomer not penalised
    tova = EvictionPolicy("score", sink_pages=0, recent_pages=1, decay=0.0)  # the last step only
    usage = _usage(tova, [30, 31, 32], [[0.0, 1.0, 0.0], [0.6, 0.1, 0.3]])
    assert tova.victim([30, 31, 32], 0, usage) == 1


def test_usage_signal_defaults_follow_the_page_size():
    """One-token pages follow what the last query takes from them, averaged over heads (the output they move
    in a streaming "score" cache; "lru" and a compressed prompt's cut count attention); larger pages a decayed
    window's most attentive head's attention; explicit arguments win; "lru" cannot take the output signal."""
    tova = hf_paged.PagedCache(page_size=1, max_pages=8).policy
    assert (tova.decay, tova.observation_window, tova.heads, tova.signal) == (0.0, 1, "mean", "output")
    assert hf_paged.PagedCache(page_size=1, max_pages=8, eviction="lru").policy.signal == "attention"
    assert hf_paged.PagedCache(page_size=1, max_pages=8, compress_prompt=True).policy.signal == "attention"
    pages = hf_paged.PagedCache(page_size=4, max_pages=8).policy
    assert (pages.decay, pages.observation_window, pages.heads, pages.signal) == (0.9, 32, "max", "attention")
    mine = hf_paged.PagedCache(page_size=1, max_pages=8, score_decay=0.5, observation_window=4, score_heads="max",
                               score_signal="attention")
    mine = mine.policy
    assert (mine.decay, mine.observation_window, mine.heads, mine.signal) == (0.5, 4, "max", "attention")
    assert hf_paged.PagedCache(page_size=4, max_pages=8, score_signal="output").policy.signal == "output"
    with pytest.raises(CacheUsageError, match="score_signal"):
        hf_paged.PagedCache(page_size=1, max_pages=8, score_signal="value")
    with pytest.raises(CacheUsageError, match="needs eviction='score'"):
        hf_paged.PagedCache(page_size=1, max_pages=8, eviction="lru", score_signal="output")
    mass = torch.tensor([[[0.9, 0.1], [0.1, 0.1]]])  # [B=1, H=2, pages=2]
    assert torch.allclose(tova.page_signal(mass), torch.tensor([[0.5, 0.1]]))
    assert torch.allclose(pages.page_signal(mass), torch.tensor([[0.9, 0.1]]))


@pytest.mark.parametrize("name", ["score", "lru", "fifo"])
def test_victims_in_one_call_equal_single_picks(name):
    """Choosing k victims at once (a prompt cut, a chunk's room) gives the pages k single picks would."""
    policy = EvictionPolicy(name, sink_pages=2, recent_pages=3, decay=0.5)
    g = torch.Generator().manual_seed(1)
    pages = list(range(40, 70))
    usage = _usage(policy, pages, torch.rand(4, len(pages), generator=g).round(decimals=1).tolist())
    row = [p if i % 7 else EVICTED for i, p in enumerate(pages)]
    batch = policy.victims(row, 1, usage, 12)
    single, left = [], list(row)
    for _ in range(12):
        i = policy.victim(left, 1, usage)
        single.append(i)
        left[i] = EVICTED
    assert batch == single and len(set(batch)) == 12
    # the order, worked out independently: unprotected live pages (logical index >= 2 sinks, not among the
    # 3 newest live ones) by rank, ties by age
    live = [i for i, p in enumerate(row) if p != EVICTED]
    candidates = [i for i in live[:-3] if 1 + i >= 2]
    rank = {"fifo": lambda i: 0, "lru": lambda i: int(usage.last_used[row[i]]),
            "score": lambda i: float(policy.scores(usage, torch.tensor([row[i]]))[0])}[name]
    assert batch == sorted(candidates, key=lambda i: (rank(i), i))[:12]


def test_lru_threshold_is_relative_to_an_even_share():
    """The signal discriminates: with 4 live pages, 0.2 of the mass is below an even share (0.25), 0.3 above."""
    policy = EvictionPolicy("lru", sink_pages=0, recent_pages=1, threshold=1.0)
    usage = _usage(policy, [1, 2, 3, 4], [[0.3, 0.2, 0.2, 0.3], [0.2, 0.3, 0.2, 0.3]])
    assert usage.last_used[1] == 3 and usage.last_used[2] == 5 and usage.last_used[3] == 0
    assert policy.victim([1, 2, 3, 4], 0, usage) == 2
    assert EvictionPolicy("lru", sink_pages=0, recent_pages=3).victim([1, 2, 3, 4], 0, usage) == 0


def test_fifo_and_protected_pages_on_synthetic_rows():
    usage = PageHistory()
    row = [10, 11, 12, 13, 14, 15]
    assert EvictionPolicy("fifo", sink_pages=1, recent_pages=1).victim(row, 0, usage) == 1  # oldest after sink
    assert EvictionPolicy("fifo", sink_pages=0, recent_pages=1).victim(row, 0, usage) == 0
    assert EvictionPolicy("fifo", sink_pages=3, recent_pages=2).victim(row, 0, usage) == 3
    assert EvictionPolicy("fifo", sink_pages=1, recent_pages=1).victim(row, 2, usage) == 0  # sink already gone
    assert EvictionPolicy("score", sink_pages=1, recent_pages=1).victim([10, EVICTED, 12], 0, usage) is None


@pytest.mark.parametrize("eviction", ["score", "lru", "fifo"])
def test_protected_pages_are_never_evicted(llama, eviction):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=5, config=paged.config, eviction=eviction,
                                sink_pages=2, recent_pages=2)
    paged.generate(**left_padded_batch((6,)), max_new_tokens=30, **GEN, cache=cache)
    row = cache.layers[0].group.rows[0]
    assert cache.stats()["evictions"] > 0
    assert row[0] != EVICTED and row[1] != EVICTED  # sinks
    live = [p for p in row if p != EVICTED]
    assert row[-2:] == live[-2:] and EVICTED not in row[-2:]  # recent window
    assert len(live) == 5
    check_pages(cache)


@pytest.mark.parametrize("eviction", ["score", "lru"])
def test_the_page_attention_ignores_goes_per_row(eviction):
    """Synthetic attention, two rows: each row loses its own least attended page (not the oldest, as fifo would)."""
    cache = hf_paged.PagedCache(page_size=1, max_pages=8, eviction=eviction, sink_pages=0, recent_pages=1)
    k = torch.randn(2, 1, 4, 2)  # rows differ: no shared pages
    cache.update(k, k, 0)
    group = cache.layers[0].group
    group.step.add_usage(torch.tensor([[0.4, 0.0, 0.4, 0.2], [0.0, 0.4, 0.3, 0.3]]))
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # one more token per row: one page of each row goes
    assert [r.index(EVICTED) for r in group.rows] == [1, 0]
    assert all(r.count(EVICTED) == 1 for r in group.rows)
    fifo = hf_paged.PagedCache(page_size=1, max_pages=8, eviction="fifo", sink_pages=0, recent_pages=1)
    fifo.update(k, k, 0)
    fifo.update(k[:, :, :1], k[:, :, :1], 0)
    assert [r.index(EVICTED) for r in fifo.layers[0].group.rows] == [0, 0]


def test_fork_keeps_the_usage_and_evicts_on_its_own():
    cache = hf_paged.PagedCache(page_size=1, max_pages=12, eviction="score", sink_pages=0, recent_pages=1)
    k = torch.zeros(1, 1, 4, 2)
    cache.update(k, k, 0)
    cache.layers[0].group.step.add_usage(torch.tensor([[0.3, 0.3, 0.0, 0.4]]))
    twin = cache.fork()
    for _ in range(5):  # the shared pool fills up: each cache drops its least attended page first
        for c in (cache, twin):
            c.update(k[:, :, :1], k[:, :, :1], 0)
    assert twin.layers[0].group.rows[0][2] == EVICTED and cache.layers[0].group.rows[0][2] == EVICTED
    check_pages(cache, twin)


def test_compress_prompt_keeps_what_the_last_queries_attend():
    """A prompt over the bound is written whole, then cut to the bound by its last queries' attention."""
    cache = hf_paged.PagedCache(page_size=1, max_pages=4, eviction="score", sink_pages=1, recent_pages=1,
                                compress_prompt=True)
    k = torch.zeros(1, 1, 8, 2)
    cache.update(k, k, 0)  # 8 tokens on 8 pages: more than the bound, accepted
    group = cache.layers[0].group
    assert group.manager.num_used == 8
    group.step.add_usage(torch.tensor([[0.3, 0.0, 0.2, 0.0, 0.0, 0.3, 0.0, 0.2]]))
    stats = cache.stats()  # commits the step: cut to 4 pages
    assert stats["pages_used"] == 4 and stats["tokens_stored"] == 4
    assert [i for i, p in enumerate(group.rows[0]) if p != EVICTED] == [0, 2, 5, 7]
    cache.update(k[:, :, :1], k[:, :, :1], 0)  # decoding stays within the bound
    assert cache.stats()["pages_used"] == 4
    check_pages(cache)
    with pytest.raises(hf_paged.PagePoolExhausted, match="in chunks"):  # without it: feed the prompt in chunks
        hf_paged.PagedCache(page_size=1, max_pages=4).update(k, k, 0)


def test_compress_prompt_generates_within_the_bound(llama):
    ref, paged = llama
    batch = left_padded_batch((20, 14))
    cache = hf_paged.PagedCache(page_size=2, max_pages=12, config=paged.config, compress_prompt=True)
    got = paged.generate(**batch, max_new_tokens=8, **GEN, cache=cache)
    stats = cache.stats()
    assert stats["evictions"] > 0 and most_pages_held(cache) <= 12 and got.shape == (2, 28)
    check_pages(cache)
    roomy = hf_paged.PagedCache(page_size=2, max_pages=40, config=paged.config, compress_prompt=True)
    want = ref.generate(**batch, max_new_tokens=8, **GEN, cache=DynamicCache(config=ref.config))
    assert torch.equal(paged.generate(**batch, max_new_tokens=8, **GEN, cache=roomy), want)  # within budget: exact


@pytest.mark.parametrize("eviction", ["score", "lru", "fifo"])
def test_budget_covering_the_sequence_equals_unbounded(llama, eviction):
    ref, paged = llama
    batch = left_padded_batch((9, 5, 12))
    want = ref.generate(**batch, max_new_tokens=10, **GEN, cache=DynamicCache(config=ref.config),
                        return_dict_in_generate=True, output_scores=True)
    cache = hf_paged.PagedCache(page_size=4, max_pages=3 * 6, config=paged.config, eviction=eviction)
    got = paged.generate(**batch, max_new_tokens=10, **GEN, cache=cache, return_dict_in_generate=True,
                         output_scores=True)
    assert cache.stats()["evictions"] == 0
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_an_eviction_interval_generates_within_the_bound_and_exactly_within_budget(llama):
    """``eviction_interval=4`` in ``generate`` (pages of one token, a compressed prompt, beams): within its budget the
    tokens are DynamicCache's; over it the cache holds its bound at every step, as many tokens and evictions as with
    an interval of 1 (one victim a row a step, only chosen 4 at a time)."""
    ref, paged = llama
    batch = left_padded_batch((20, 14))
    want = ref.generate(**batch, max_new_tokens=8, **GEN, cache=DynamicCache(config=ref.config))
    roomy = hf_paged.PagedCache(page_size=1, max_pages=80, config=paged.config, eviction_interval=4)
    assert torch.equal(paged.generate(**batch, max_new_tokens=8, **GEN, cache=roomy), want)
    stats = []
    for interval in (1, 4):
        cache = hf_paged.PagedCache(page_size=1, max_pages=2 * 12, config=paged.config, compress_prompt=True,
                                    eviction_interval=interval)
        got = paged.generate(**batch, max_new_tokens=24, **GEN, cache=cache)
        assert got.shape == (2, 44) and most_pages_held(cache) <= 24
        stats.append({k: cache.stats()[k] for k in ("evictions", "tokens_held")})
        check_pages(cache)
    assert stats[0] == stats[1] and stats[0]["evictions"] > 0
    beams = hf_paged.PagedCache(page_size=1, max_pages=4 * 8, config=paged.config, compress_prompt=True,
                                eviction_interval=4)
    paged.generate(**left_padded_batch((20,)), max_new_tokens=12, num_beams=4, num_return_sequences=1,
                   pad_token_id=0, eos_token_id=None, do_sample=False, cache=beams)
    assert beams.stats()["evictions"] > 0 and most_pages_held(beams) <= 4 * 8
    check_pages(beams)


def test_eviction_changes_output_and_logs_once(llama, caplog):
    _, paged = llama
    batch = left_padded_batch((6,))
    full = paged.generate(**batch, max_new_tokens=16, **GEN, cache=hf_paged.PagedCache(page_size=2))
    with caplog.at_level(logging.WARNING):
        bounded = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
        got = paged.generate(**batch, max_new_tokens=16, **GEN, cache=bounded)
    assert bounded.stats()["evictions"] > 0 and most_pages_held(bounded) <= 4
    assert bounded.get_seq_length() == 6 + 15  # tokens processed, not stored
    assert got.shape == full.shape
    assert caplog.text.count("evicting pages") <= 1


def test_eviction_with_batch_and_beams_keeps_reference_counts(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=14, config=paged.config, eviction="lru",
                                sink_pages=1)
    paged.generate(**left_padded_batch((10, 7)), max_new_tokens=12, num_beams=3, **GEN, cache=cache)
    assert cache.stats()["evictions"] > 0
    check_pages(cache)
    cache.reset()
    check_pages(cache)
    assert cache.stats()["pages_used"] == 0


def test_prompt_larger_than_the_budget_says_to_chunk(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
    with pytest.raises(hf_paged.PagePoolExhausted, match="in chunks"):
        paged.generate(**left_padded_batch((20,)), max_new_tokens=2, **GEN, cache=cache)
    check_pages(cache)


def test_evicted_cache_refuses_other_attention(llama):
    ref, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=4, config=paged.config)
    paged.generate(**left_padded_batch((6,)), max_new_tokens=6, **GEN, cache=cache)
    assert cache.stats()["evictions"] > 0
    with pytest.raises(hf_paged.CacheUsageError, match="only the 'hf_paged' attention"):
        ref(input_ids=torch.tensor([[5]]), cache=cache)


@pytest.mark.parametrize("bad", [dict(eviction="random"), dict(sink_pages=-1), dict(recent_pages=1.5),
                                 dict(lru_threshold=0.0), dict(score_decay=1.0),
                                 dict(observation_window=0), dict(score_heads="median")])
def test_bad_eviction_arguments(bad):
    with pytest.raises(hf_paged.CacheUsageError):
        hf_paged.PagedCache(max_pages=8, **bad)


def test_soak_bounded_cache_with_forks_and_resets(llama):
    """Hundreds of generate calls on one bounded cache: page accounting returns to its baseline."""
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=12, config=paged.config, eviction="fifo")
    g = torch.Generator().manual_seed(0)
    baseline = None
    for i in range(200):
        cache.reset()
        prompt = torch.randint(3, 96, (1, int(torch.randint(2, 12, (1,), generator=g))), generator=g)
        paged.generate(input_ids=prompt, max_new_tokens=int(torch.randint(1, 8, (1,), generator=g)), **GEN,
                       cache=cache)
        if i % 3 == 0:
            fork = cache.fork()
            paged(input_ids=torch.tensor([[7]]), cache=fork)
            del fork
        check_pages(cache)
        if i == 100:
            gc.collect()
            baseline = cache.stats()["pages_total"], cache.stats()["pool_bytes"]
    cache.reset()
    gc.collect()
    stats = cache.stats()
    assert stats["pages_used"] == 0 and stats["pages_free"] + stats["pages_cached"] == stats["pages_total"]
    assert (stats["pages_total"], stats["pool_bytes"]) == baseline  # memory stopped growing
    assert stats["pages_total"] <= 12  # and stays within the bound


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_holes_left_by_eviction_are_exactly_masked_out(llama, backend):
    """After evicting pages from the middle of a row, a step attends exactly the kept tokens: the same as the
    reference model with a mask hiding the evicted positions."""
    ref, paged = llama
    ids = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(1))
    cache = hf_paged.PagedCache(page_size=2, max_pages=16, config=paged.config, backend=backend)
    paged(input_ids=ids[:, :12], cache=cache)
    cache.commit()
    for group in cache.groups.values():  # every layer loses the same tokens
        for i in (1, 3, 4):  # tokens 2-3 and 6-9
            group.manager.release(group.rows[0][i])
            group.rows[0][i] = EVICTED
    got = paged(input_ids=ids[:, 12:], cache=cache).logits
    keep = torch.ones(1, 1, 1, 13, dtype=torch.bool)
    keep[..., [2, 3, 6, 7, 8, 9]] = False
    dyn = DynamicCache(config=ref.config)
    ref(input_ids=ids[:, :12], cache=dyn)
    want = ref(input_ids=ids[:, 12:], cache=dyn, attention_mask=keep).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    check_pages(cache)


def _attended(cache, layer_masses: list[list[float]], tokens: int) -> None:
    """Write ``tokens`` tokens into every layer of ``cache``; layer i's step sees ``layer_masses[i]`` per page."""
    k = torch.randn(1, 1, tokens, 2, generator=torch.Generator().manual_seed(tokens))
    for i, mass in enumerate(layer_masses):
        cache.update(k, k, i)
        if mass is not None:
            cache.layers[i].group.step.add_usage(torch.tensor([mass]))


@pytest.mark.parametrize("eviction", ["score", "lru"])
def test_each_layer_evicts_the_page_its_own_attention_ignores(eviction):
    cache = hf_paged.PagedCache(page_size=1, max_pages=4, eviction=eviction, sink_pages=0, recent_pages=1)
    assert cache.per_layer_eviction  # the default of a bounded cache that tracks usage
    _attended(cache, [[0.4, 0.0, 0.4, 0.2], [0.0, 0.4, 0.4, 0.2]], 4)
    _attended(cache, [None, None], 1)  # one more token: each layer drops one page of its own choice
    assert [layer.group.rows[0].index(EVICTED) for layer in cache.layers] == [1, 0]
    assert len(cache.groups) == 2
    shared = hf_paged.PagedCache(page_size=1, max_pages=4, eviction=eviction, sink_pages=0, recent_pages=1,
                                 per_layer_eviction=False)
    _attended(shared, [[0.4, 0.0, 0.4, 0.2], [0.0, 0.0, 0.4, 0.2]], 4)  # the layers' attention is summed
    _attended(shared, [None, None], 1)
    assert len(shared.groups) == 1 and shared.layers[0].group.rows[0].index(EVICTED) == 1
    check_pages(cache, shared)


def test_per_layer_eviction_is_the_default_only_where_it_can_differ(llama):
    _, paged = llama
    per_layer = hf_paged.PagedCache(page_size=2, max_pages=6, config=paged.config)
    assert per_layer.per_layer_eviction and len(per_layer.groups) == paged.config.num_hidden_layers
    assert len({id(layer.group) for layer in per_layer.layers}) == paged.config.num_hidden_layers
    for kwargs in (dict(max_pages=6, eviction="fifo"), dict(max_pages=6, eviction="error"), dict()):
        cache = hf_paged.PagedCache(page_size=2, config=paged.config, **kwargs)  # every layer would choose alike
        assert not cache.per_layer_eviction and len(cache.groups) == 1


def test_per_layer_eviction_with_beams_forks_and_reset(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=2, max_pages=16, config=paged.config, eviction="score", sink_pages=1)
    paged.generate(**left_padded_batch((9, 6)), max_new_tokens=24, num_beams=2, **GEN, cache=cache)
    rows = [[tuple(r) for r in layer.group.rows] for layer in cache.layers]
    assert cache.stats()["evictions"] > 0 and most_pages_held(cache) <= 16
    twin = cache.fork()
    paged(input_ids=torch.tensor([[7], [8], [9], [10]]), cache=twin)
    check_pages(cache, twin)
    assert [[tuple(r) for r in layer.group.rows] for layer in cache.layers] == rows  # the fork wrote its own
    del twin
    cache.reset()
    check_pages(cache)
    assert cache.stats()["pages_used"] == 0


def test_set_max_pages_lifts_or_lowers_the_bound():
    cache = hf_paged.PagedCache(page_size=1, max_pages=4, eviction="score", sink_pages=1, recent_pages=1,
                                compress_prompt=True)
    _attended(cache, [[0.3, 0.0, 0.2, 0.0, 0.0, 0.3, 0.0, 0.2]], 8)  # a prompt, cut to 4 pages after it
    assert most_pages_held(cache) == 4 and cache.stats()["evictions"] == 4
    with pytest.raises(hf_paged.CacheUsageError, match="holds 4 pages"):
        cache.set_max_pages(3)
    with pytest.raises(hf_paged.CacheUsageError, match="max_pages"):
        cache.set_max_pages(0)
    assert cache.max_pages == 4 and most_pages_held(cache) == 4  # nothing changed
    cache.set_max_pages(None)  # the answer may grow on top of the compressed prompt
    for _ in range(3):
        _attended(cache, [None], 1)
    assert most_pages_held(cache) == 7 and cache.stats()["evictions"] == 4
    cache.set_max_pages(7)
    _attended(cache, [None], 1)
    assert most_pages_held(cache) == 7 and cache.stats()["evictions"] == 5
    check_pages(cache)


def test_the_first_eviction_under_each_bound_is_logged(monkeypatch):
    """A group asks for the lossy-eviction warning once per bound, not at every evicting step."""
    logged = []
    monkeypatch.setattr(hf_paged.eviction, "warn_first_eviction", lambda policy, bound: logged.append(bound))
    cache = hf_paged.PagedCache(page_size=1, max_pages=4, eviction="score", sink_pages=1, recent_pages=1)
    for _ in range(7):  # four tokens fill the pool, three evict
        _attended(cache, [None], 1)
    cache.set_max_pages(None)
    _attended(cache, [None], 1)  # 5 pages held
    cache.set_max_pages(5)
    for _ in range(2):
        _attended(cache, [None], 1)
    cache.commit()
    assert cache.stats()["evictions"] == 5 and logged == [4, 5]


def test_a_decode_step_after_compression_attends_only_the_kept_pages(llama):
    """The prompt's last page is partial, so the next token goes into it: its plan must come from the rows as
    compression left them (the reference hides the evicted positions), not from the prompt's step."""
    ref, paged = llama
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(2))
    cache = hf_paged.PagedCache(page_size=4, max_pages=2, config=paged.config, compress_prompt=True,
                                per_layer_eviction=False)
    paged(input_ids=ids[:, :10], cache=cache)
    cache.commit()  # the 10-token prompt (pages 0, 1 and a partial 2) is cut to 2 pages: the sink and the last
    assert cache.layers[0].group.rows[0][1] == EVICTED
    got = paged(input_ids=ids[:, 10:], cache=cache).logits
    keep = torch.ones(1, 1, 1, 11, dtype=torch.bool)
    keep[..., 4:8] = False
    dyn = DynamicCache(config=ref.config)
    ref(input_ids=ids[:, :10], cache=dyn)
    want = ref(input_ids=ids[:, 10:], cache=dyn, attention_mask=keep).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    check_pages(cache)


def test_rows_with_different_holes_are_read_through_padded_live_tables():
    """A step's live-page index: each row's live pages in order, -1 padded, and the padding placed at
    ``num_tokens``, a position no query of the step may attend."""
    from hf_paged.step_plan import build_plan

    rows = [[10, EVICTED, 12, 13], [20, EVICTED, EVICTED, 23]]  # logical pages 1..4 of 2 tokens: tokens 2..9
    plan = build_plan(rows, first_page=1, past=9, num_tokens=10, page_size=2, src=[], dst=[], same_as=None,
                      live_read=False)
    assert plan.read_table.tolist() == [[10, 12, 13], [20, 23, EVICTED]]
    assert plan.read_pos.tolist() == [[2, 6, 8], [2, 8, 10]]
    assert plan.slots.tolist() == [13 * 2 + 1, 23 * 2 + 1] and plan.slab is None
    whole = build_plan([[4, 5, 6]], first_page=0, past=5, num_tokens=6, page_size=2, src=[], dst=[], same_as=None,
                       live_read=False)
    assert whole.read_table is None and whole.slab == (4, 3)


def _live_entries(plan) -> list[list[tuple[int, int]]]:
    """Each row's (page, position) of its live entries, in position order."""
    return [sorted(((p, q) for p, q in zip(pages, pos) if p != EVICTED), key=lambda entry: entry[1])
            for pages, pos in zip(plan.read_table.tolist(), plan.read_pos.tolist())]


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("rows", [1, 3])
def test_decode_steps_edit_the_last_plan_as_a_full_plan_would_build_it(rows, tokens, monkeypatch):
    """A step into a full pool evicts pages and gains as many: its plan edits the last one in place and equals the
    plan built from scratch (holes and padding included, live entries in any order). One new page per row (a
    decode step at page size 1) recycles each row's victim page in its live column; more extend the last plan
    (holes, appended columns, a full re-index once holes fill 1/8 of the live table). A row edited behind the
    plan's back is planned in full."""
    from hf_paged import eviction, layer_groups
    from hf_paged.eviction import recycle_plan
    from hf_paged.step_plan import build_plan

    full_plans, recycled = [], []
    monkeypatch.setattr(layer_groups, "build_plan", lambda *a, **k: full_plans.append(a) or build_plan(*a, **k))
    monkeypatch.setattr(eviction, "recycle_plan", lambda *a: recycled.append(a) or recycle_plan(*a))
    cache = hf_paged.PagedCache(page_size=1, max_pages=256 * rows, eviction="score", sink_pages=1, recent_pages=1)

    def step(count, seed):
        k = torch.randn(rows, 1, count, 2, generator=torch.Generator().manual_seed(seed))
        cache.update(k, k, 0)
        plan = cache.layers[0].group.step
        plan.add_usage(torch.rand(plan.read_table.shape, generator=torch.Generator().manual_seed(seed)))
        return plan

    step(256, 0)
    group = cache.layers[0].group
    for i in range(200):  # evictions every step; buffers grow past their first capacity
        if rows > 1 and i == 50:  # one row loses a page no other row loses: padded live tables from here on
            cache.commit()
            index = next(j for j in range(1, 256) if group.rows[1][j] != EVICTED)
            group.manager.release(group.rows[1][index])
            group.rows[1][index] = EVICTED
            planned = len(full_plans)
        plan = step(tokens, i + 1)
        if rows > 1 and i == 50:
            assert len(full_plans) == planned + 1 and bool((plan.read_table == EVICTED).any())  # padding
        want = build_plan(group.rows, group.first_page, plan.past, plan.num_tokens, 1, [], [], None, True)
        assert torch.equal(plan.table, want.table) and torch.equal(plan.slots, want.slots)
        assert _live_entries(plan) == _live_entries(want), i  # holes may sit anywhere in a live table
        assert (plan.read_pos[plan.read_table == EVICTED] == plan.num_tokens).all()
    assert len(recycled) == (200 - (rows > 1) if tokens == 1 else 0)
    assert len(full_plans) <= 2 + 200 * tokens // 25 and cache.stats()["evictions"] == 200 * rows * tokens - (rows > 1)
    check_pages(cache)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("eviction", ["score", "score-decayed", "lru", "fifo"])
def test_recycled_steps_evict_what_the_general_path_evicts(eviction, page_size, monkeypatch):
    """A recycled step picks its victims in the live table's columns: the same pages (by position) as the general
    path, which ranks each row in logical order, under the same attention (a function of each page's position
    and layer, least on the newest pages, which only their protection keeps, fewer of them in later layers; ties
    among the ranks, which "lru" makes common, go to the oldest page). Three layers, each its own group with a usage
    policy: their steps are planned together, one plan per step (`PlanStack`: recycled steps, and with pages of
    several tokens the steps between), and equal the steps each group plans alone (`GroupEviction.recycle`) and the
    general path's, where each group records its own usage row by row; "score" records their steps in one pass over
    all of them (`record_together`), and without decay picks their victims in it too."""
    from hf_paged import layer_groups
    from hf_paged.eviction import EvictionPolicy, GroupEviction, PlanStack
    from hf_paged.layer_groups import LayerGroups

    recycled, stacked, general, stack_recycle = [], [], GroupEviction.recycle, PlanStack.recycle

    def recycle(self, manager, rows, num_tokens, q_len, last):
        together = last is not None and last.victims is not None
        recycled.append((general(self, manager, rows, num_tokens, q_len, last), together))
        return recycled[-1][0]

    def recycle_stack(self, groups, q_len):
        stacked.append((stack_recycle(self, groups, q_len), all(g.step.victims is not None for g in groups)))
        return stacked[-1][0]

    def run(path: str):
        monkeypatch.setattr(GroupEviction, "recycle", recycle if path != "general" else lambda *a: None)
        monkeypatch.setattr(PlanStack, "recycle", recycle_stack)
        if path != "together":
            monkeypatch.setattr(LayerGroups, "plan_together", lambda *a: None)
        if path == "general":
            monkeypatch.setattr(layer_groups, "record_together", lambda *a: None)
            monkeypatch.setattr(EvictionPolicy, "whole_shares", lambda *a: None)
        name, decay = ("score", 0.5) if eviction == "score-decayed" else (eviction, None)
        cache = hf_paged.PagedCache(page_size=page_size, max_pages=96 // page_size, eviction=name,
                                    sink_pages=4 // page_size, recent_pages=2, score_decay=decay)
        kept = []
        for i in range(120):
            k = torch.randn(2, 1, 40 if i == 0 else 1, 2, generator=torch.Generator().manual_seed(i))
            for layer in range(3):
                cache.update(k, k, layer)
                plan = cache.layers[layer].group.step
                if plan.read_table is not None:
                    position = plan.read_pos.double()
                    mass = 0.05 + ((position * 0.37 + i * 0.11 + layer * 0.29) % 1.0).round(decimals=1)
                    newest = position >= plan.num_tokens - 3 + layer  # the least attended, the newest least of all
                    mass[newest] = (plan.num_tokens - 1 - position[newest]) * 0.01
                    plan.add_usage(mass * (plan.read_table >= 0))
                pages, positions = plan.live_pages()
                kept.append([sorted(p for p, page in zip(row_pos, row) if page != EVICTED)
                             for row_pos, row in zip(positions.tolist(), pages.tolist())])
        monkeypatch.undo()
        check_pages(cache)
        return kept, cache.stats()["evictions"]

    together = run("together")
    assert together == run("per group") == run("general")
    groups, recycling = (1 if eviction == "fifo" else 3), 100 // page_size  # steps after the pool filled
    assert sum(picks is not None for picks, _ in recycled) >= recycling * groups
    assert sum(done for done, _ in stacked) >= (0 if groups == 1 else recycling)  # (planned together: no group recycled)
    picked_together = sum(with_victims for _, with_victims in recycled + stacked)
    no_decay = eviction == "score" and page_size == 1  # (pages of several tokens decay their scores by default)
    assert picked_together >= recycling * groups if no_decay else picked_together == 0


def test_a_step_planned_together_that_fails_is_rolled_back_at_the_first_question():
    """Per-layer groups of a full pool plan a step together (every group begins it with the first layer): when a
    forward fails after some layers wrote it, the next question about a layer that wrote it (``get_seq_length``, the
    first thing a forward asks) rolls it back in every group, as when each group planned its own; the next step goes
    on from there, planned together again."""
    cache = hf_paged.PagedCache(page_size=1, max_pages=24, eviction="score", sink_pages=1)

    def step(count, seed, layers=range(3)):
        k = torch.randn(2, 1, count, 2, generator=torch.Generator().manual_seed(seed))
        for layer in layers:
            cache.update(k, k, layer)
            plan = cache.layers[layer].group.step
            plan.add_usage(torch.rand(plan.read_table.shape, generator=torch.Generator().manual_seed(seed + layer)))

    step(12, 0)
    for i in range(6):
        step(1, i + 1)
    assert cache.groups.stack is not None
    held = cache.get_seq_length()
    step(1, 50, layers=range(2))  # the last layer never writes the step
    assert cache.get_seq_length() == held
    assert [layer.get_seq_length() for layer in cache.layers] == [held] * 3
    check_pages(cache)
    for i in range(3):
        step(1, 60 + i)
    assert cache.get_seq_length() == held + 3 and cache.groups.stack is not None
    check_pages(cache)


@pytest.mark.parametrize("decay", [None, 0.5])
def test_a_stack_commits_and_rolls_back_every_group_as_each_group_alone(decay, monkeypatch):
    """The steps a `PlanStack` plans for every layer's group are also committed by it (`PlanStack.record`: the
    usage the kernels wrote into its buffer, recorded in one pass; each group's step then only ends): rows, tokens,
    histories, victims and stats equal those of the same steps planned, recorded and committed group by group, at
    every step. A failed step rolls back in every group, each as it was but for the victims it evicted (which
    stand, as a recycled step's always did): the pages are free, the tokens and tables' lengths as before."""
    from hf_paged import layer_groups

    def run(together: bool, fail: int | None = None):
        if not together:
            monkeypatch.setattr(layer_groups.LayerGroups, "plan_together", lambda *a: None)
        ended = []
        record = layer_groups.record_together
        monkeypatch.setattr(layer_groups, "record_together", lambda *a: ended.append(record(*a)) or ended[-1])
        cache = hf_paged.PagedCache(page_size=1, max_pages=64, eviction="score", sink_pages=1, score_decay=decay,
                                    eviction_interval=1)  # (every step observed and recorded)
        seen = []
        for i in range(40):
            k = torch.randn(2, 1, 30 if i == 0 else 1, 2, generator=torch.Generator().manual_seed(i))
            for layer in range(2 if i == fail else 3):  # a failed step: its last layer never writes it
                view = cache.update(k, k, layer)[0].paged
                mass = torch.rand(view.plan.read_table.shape, generator=torch.Generator().manual_seed(i * 3 + layer))
                out = view.probe.into()  # (where a kernel writes the usage it reports)
                view.probe.report(mass if out is None else out.copy_(mass))
            cache.get_seq_length()  # (the first question of the next forward: a failed step rolls back)
            cache.commit()
            assert not cache.groups.step_open
            if i == 25:  # a history grows (as a fork's step may grow the histories it shares): stacked anew
                next(iter(cache.groups.values())).eviction.history.cover(torch.tensor([500]).numpy())
            groups = cache.groups.values()
            seen.append((cache.get_seq_length(), cache.stats(), [[list(r) for r in g.rows] for g in groups],
                         [(g.eviction.history.ema[:64].tolist(), g.eviction.history.observed[:64].tolist(),
                           g.eviction.history.last_used[:64].tolist(), g.eviction.evictions, g.eviction.clock,
                           None if g.step is None or g.step.victims is None else g.step.victims.tolist())
                          for g in groups]))
        monkeypatch.undo()
        check_pages(cache)
        return seen, sum(ended)

    (stacked, ended), (alone, _) = run(True), run(False)
    assert stacked == alone
    assert ended >= (30 if decay is None else 0)  # (the stack ended its steps: without decay, every fold is one)
    failed, _ = run(True, fail=20)
    assert failed[:20] == stacked[:20]
    (tokens, stats, rows, _), (before, before_stats, before_rows, _) = failed[20], failed[19]
    evicted = sum(page == EVICTED and kept != EVICTED for group, kept_group in zip(rows, before_rows)
                  for row, kept_row in zip(group, kept_group) for page, kept in zip(row, kept_row))
    assert tokens == before and failed[21][0] == before + 1 and 0 < evicted <= 3 * 2
    assert [[[k if p == EVICTED else p for p, k in zip(r, kr)] for r, kr in zip(g, kg)]
            for g, kg in zip(rows, before_rows)] == before_rows  # (each row as before, but its victim)
    assert stats["evictions"] - before_stats["evictions"] == evicted
    assert before_stats["pages_used"] - stats["pages_used"] == evicted


def test_after_a_failed_step_planned_together_groups_of_several_layers_plan_their_own():
    """Groups of several layers each (a sliding window wider than the text, "fifo": one group per window) plan a step
    together too; after one fails and is rolled back at the next step's first layer, that step is planned group by
    group, and a group's first layer finding another group's step open (its later layers still to come) is no
    failure."""
    from tiny_models import hybrid_cache_config

    layer_types = ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    cache = hf_paged.PagedCache(page_size=1, max_pages=24, eviction="fifo", sink_pages=1,
                                config=hybrid_cache_config(64, layer_types))

    def step(count, seed, layers=range(4)):
        k = torch.randn(2, 1, count, 2, generator=torch.Generator().manual_seed(seed))
        for layer in layers:
            cache.update(k, k, layer)

    step(12, 0)
    for i in range(20):
        step(1, i + 1)
    assert len(cache.groups) == 2 and cache.groups.stack is not None
    held = cache.get_seq_length()
    step(1, 50, layers=range(3))  # the last layer never writes the step
    step(1, 51)
    assert [layer.get_seq_length() for layer in cache.layers] == [held + 1] * 4
    check_pages(cache)


def test_a_whole_eviction_policy_stands_for_the_flat_keywords():
    """``PagedCache(eviction=EvictionPolicy(...))`` evicts as the same settings given as keywords; mixing both is
    refused, naming the keyword to move into the policy."""
    _, paged = make_pair("llama")
    prompt = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(5))
    flat = hf_paged.PagedCache(page_size=4, max_pages=16, eviction="lru", sink_pages=1, recent_pages=2)
    policy = EvictionPolicy("lru", sink_pages=1, recent_pages=2)
    whole = hf_paged.PagedCache(page_size=4, max_pages=16, eviction=policy)
    assert whole.policy == flat.policy
    outs = [paged.generate(prompt, max_new_tokens=6, do_sample=False, **{hf_paged.CACHE_KWARG: cache})
            for cache in (flat, whole)]
    assert torch.equal(*outs) and flat.stats()["evictions"] == whole.stats()["evictions"] > 0
    with pytest.raises(hf_paged.CacheUsageError, match="set recent_pages, score_decay in it"):
        hf_paged.PagedCache(eviction=EvictionPolicy("fifo"), recent_pages=3, score_decay=0.5)


def test_the_default_interval_serves_one_token_pages_ranked_by_their_last_share():
    """Without ``eviction_interval`` a bounded cache of one-token pages under "score" with no decay (the default
    policy, streaming or cutting a prompt) queues `DEFAULT_INTERVAL` victims; every other policy, page size and the
    per-head cache choose one victim a step; an explicit k is kept, and refused where queues cannot serve."""
    default = DEFAULT_INTERVAL
    assert default > 1
    assert hf_paged.PagedCache(page_size=1, max_pages=8).policy.interval == default
    assert hf_paged.PagedCache(page_size=1, max_pages=8, compress_prompt=True).policy.interval == default
    assert hf_paged.PagedCache(page_size=1, max_pages=8, eviction_interval=1).policy.interval == 1
    for options in (dict(page_size=16), dict(page_size=1, eviction="lru"), dict(page_size=1, eviction="fifo"),
                    dict(page_size=1, score_decay=0.5), dict(page_size=1, per_head_eviction=True)):
        assert hf_paged.PagedCache(max_pages=8, **options).policy.interval == 1, options
    with pytest.raises(CacheUsageError, match="eviction_interval"):
        hf_paged.PagedCache(page_size=1, max_pages=8, per_head_eviction=True, eviction_interval=default)
    whole = EvictionPolicy.for_pages(1)
    assert whole.interval == default and hf_paged.PagedCache(page_size=1, max_pages=8, eviction=whole).policy is whole
    with pytest.raises(CacheUsageError, match="eviction_interval"):
        hf_paged.PagedCache(page_size=1, max_pages=8, eviction=whole, per_head_eviction=True)


def test_a_victim_queue_holds_each_row_s_lowest_ranks_oldest_first():
    """`EvictionPolicy.victim_queue` with an interval of k: each row's k lowest-ranked unprotected columns, lowest
    first, ties to the oldest; its first column is `victim_columns`' pick; as many columns as the row with the fewest
    unprotected pages has; None when some row has none. An interval of 1 is `victim_columns` itself."""
    import numpy as np

    shares = np.array([[0.5, 0.1, 0.3, 0.1, 0.2, 0.0], [0.4, 0.3, 0.2, 0.1, 0.0, 0.5]])
    positions = np.array([[0, 5, 2, 1, 4, 6], [0, 1, 2, 3, 4, 6]])  # (position 6 is the newest token: protected)
    policy = EvictionPolicy.for_pages(1, sink_pages=1, interval=3)
    queue = policy.victim_queue(None, positions, None, 1, 7, shares.copy())
    assert queue.tolist() == [[3, 1, 4], [4, 3, 2]]  # (row 0: 0.1 at position 1 before 0.1 at position 5)
    single = EvictionPolicy.for_pages(1, sink_pages=1, interval=1)
    assert single.victim_queue(None, positions, None, 1, 7, shares.copy()).tolist() == queue[:, 0].tolist()
    narrow = EvictionPolicy.for_pages(1, sink_pages=4, interval=3)  # row 1 keeps only position 4 unprotected
    assert narrow.victim_queue(None, positions, None, 1, 7, shares.copy()).tolist() == [[1], [4]]
    assert EvictionPolicy.for_pages(1, sink_pages=6, interval=3).victim_queue(
        None, positions, None, 1, 7, shares.copy()) is None
    with pytest.raises(CacheUsageError, match="eviction_interval"):
        hf_paged.PagedCache(page_size=4, max_pages=8, eviction_interval=2)
    with pytest.raises(CacheUsageError, match="eviction_interval must be a positive int"):
        hf_paged.PagedCache(page_size=1, max_pages=8, eviction_interval=0)


@pytest.mark.parametrize("interval", [1, 4, None])
def test_an_eviction_interval_evicts_the_queued_victims_of_one_observed_step(interval):
    """``eviction_interval=k`` (pages of one token): a full cache's stacked steps observe attention only in the step
    before a choice, choose each row's k lowest-ranked pages at once and evict one of them in each of the next k steps,
    lowest first; the budget is held at every step (never exceeded, never below it once full). With k = 1 every step
    observes and the next step evicts its lowest page; without k the cache queues `DEFAULT_INTERVAL` victims."""
    budget, layers = 32, 3
    cache = hf_paged.PagedCache(page_size=1, max_pages=2 * budget, eviction="score", sink_pages=1,
                                eviction_interval=interval)
    assert cache.policy.interval == (DEFAULT_INTERVAL if interval is None else interval)
    interval = cache.policy.interval
    queues = [None] * layers  # per layer and row: the positions its next steps evict, in turn
    observed_steps, previous = [], None
    for i in range(60):
        k = torch.randn(2, 1, 30 if i == 0 else 1, 2, generator=torch.Generator().manual_seed(i))
        chosen = {}
        for layer in range(layers):
            view = cache.update(k, k, layer)[0].paged
            if view.probe is None:
                continue
            plan = view.plan
            mass = torch.rand(plan.read_table.shape, generator=torch.Generator().manual_seed(i * 7 + layer))
            out = view.probe.into()
            view.probe.report(mass if out is None else out.copy_(mass))
            unprotected = [sorted((m, p) for m, p in zip(row_mass, row_pos) if 1 <= p < plan.num_tokens - 1)
                           for row_mass, row_pos in zip(mass.tolist(), plan.read_pos.tolist())]
            chosen[layer] = [[p for _, p in row[:interval]] for row in unprotected]
        cache.commit()
        kept = []
        for layer in cache.layers:
            table, positions = layer.group.step.live_pages()
            kept.append([sorted(p for p, page in zip(row_pos, row) if page != EVICTED)
                         for row_pos, row in zip(positions.tolist(), table.tolist())])
        assert all(len(row) == min(30 + i, budget) for group in kept for row in group)
        for layer in range(layers):
            if previous is not None and 30 + i > budget:  # one victim a row a step: the head of its queue
                gone = [sorted(set(before) - set(now)) for before, now in zip(previous[layer], kept[layer])]
                assert gone == [row[:1] for row in queues[layer]]
                queues[layer] = [row[1:] for row in queues[layer]]
            if layer in chosen:
                assert 30 + i <= budget or not any(queues[layer])  # (once full: observed when the queue is used up)
                queues[layer] = chosen[layer]
        observed_steps.append(len(chosen))
        previous = kept
    steady = observed_steps[10:]
    assert set(steady) == {0, layers} if interval > 1 else set(steady) == {layers}
    assert abs(sum(steady) / layers - len(steady) / interval) < 1  # (observed in one step of every k)
    check_pages(cache)
