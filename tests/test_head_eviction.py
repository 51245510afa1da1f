"""Eviction per KV head (`PagedCache(per_head_eviction=True)`): victims per head, the per-head floor, exactness within
budget, per-head tables in the kernels, batches / beams / forks, rollback, the budget."""

from argparse import Namespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

import hf_paged
from hf_paged.errors import CacheUsageError
from hf_paged.head_cache import HeadPagedCache
from hf_paged.head_eviction import HOLE, choose_victims, gathered_attention
from hf_paged.kernels import cpu_paged_attention as cpu_kernel
from hf_paged.kernels.reference import paged_attention_reference
from tiny_models import left_padded_batch, make_config, make_pair

pytestmark = pytest.mark.usefixtures("one_thread")
GEN = dict(pad_token_id=0, eos_token_id=None, do_sample=False)


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def check_head_pages(*caches) -> None:
    """Every head page's count in its block manager equals the table rows (of these caches, which share pools) that
    hold it; free pages are exactly those nobody holds, and the page store holds every page the manager hands out."""
    pools = {}
    for cache in caches:
        for layer in cache.layers:
            if layer.pool is None:
                continue
            empty = np.zeros(layer.pool.manager.num_pages, dtype=np.int64)
            count = pools.setdefault(id(layer.pool), (layer.pool, empty))[1]
            live = layer.table[:, :layer.width]
            np.add.at(count, live[live != HOLE], 1)
            assert (layer.held == (live != HOLE).sum(axis=1)).all()
            assert (layer.table[:, layer.width:] == HOLE).all()
    for pool, count in pools.values():
        pool.manager.check_invariants()
        assert pool.manager.ref == count.tolist()
        assert sorted(pool.manager.free) == np.flatnonzero(count == 0).tolist()
        assert pool.pages.num_pages >= pool.manager.num_pages


def within_budget(cache) -> None:
    for layer in cache.layers:
        if layer.rows:
            assert (layer.held.reshape(-1, layer.heads).sum(1) <= cache.max_pages * layer.heads).all()


def bare_cache(budget: int, head_floor: float = 0.2, heads: int = 2, prompt: int = 8, **kwargs):
    """A one-layer per-head cache (no model) holding a ``prompt`` of random keys in one row."""
    cache = hf_paged.PagedCache(page_size=1, max_pages=budget, per_head_eviction=True, backend="torch",
                                head_floor=head_floor, sink_pages=0, **kwargs)
    step(cache, prompt, heads)
    cache.commit()
    return cache


def step(cache, q_len: int, heads: int = 2, rows: int = 1):
    keys = torch.randn(rows, heads, q_len, 4)
    return cache.update(keys, torch.randn_like(keys), 0)


def observe(layer, concentrated: int = 0) -> None:
    """Constructed usage: head ``concentrated`` of each row puts all its attention on its oldest kept token, the
    other heads spread theirs evenly."""
    live = (layer.table[:, :layer.width] != HOLE).astype(np.float64)
    mass = live.copy()
    for r in range(concentrated, layer.rows, layer.heads):
        first = np.flatnonzero(live[r])[0]
        mass[r] = 0.0
        mass[r, first] = 1.0
    layer.observe(torch.from_numpy(mass))


def test_a_concentrated_head_gives_up_pages_to_the_others():
    cache = bare_cache(budget=8, head_floor=0.0)
    layer = cache.layers[0]
    observe(layer)
    step(cache, 1)
    assert layer.held.tolist() == [7, 9]  # both victims from head 0; head 1 took the freed pages
    assert layer.pool.manager.num_used == 16 and cache.stats()["head_tokens_max"] == 9
    kept0 = set(layer.pos[0][layer.table[0] != HOLE].tolist())
    assert 0 in kept0 and len(kept0 & {1, 2, 3, 4, 5, 6, 7}) == 5  # the token head 0 attends stays
    check_head_pages(cache)


@pytest.mark.parametrize("floor", [0.0, 0.5])
def test_each_head_keeps_its_floor(floor):
    cache = bare_cache(budget=8, head_floor=floor)
    layer = cache.layers[0]
    for _ in range(12):
        observe(layer)
        step(cache, 1)
        cache.commit()
        within_budget(cache)
        assert layer.held.min() >= int(floor * 8)
    assert layer.held[0] == max(int(floor * 8), 2)  # the concentrated head shrinks to its floor (or the token it
    # attends and its newest)


def test_victims_respect_the_caps_and_the_ranks():
    rank = np.array([[0.0, 0.1, 5.0, np.inf], [0.2, 0.3, 0.4, 0.5]])
    heads, columns = choose_victims(rank, np.array([1, 4]), 3)
    assert sorted(zip(heads.tolist(), columns.tolist())) == [(0, 0), (1, 0), (1, 1)]
    assert choose_victims(rank, np.array([1, 1]), 3) == (None, None)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), heads=st.integers(1, 4), width=st.integers(2, 9), count=st.integers(1, 6))
def test_victims_chosen_for_every_layer_at_once_are_each_rows_own(seed, heads, width, count):
    """`choose_stacked_victims` picks, for each (layer, row), the head pages `choose_victims` picks for it alone: the
    lowest ranks where no head exceeds its cap, the capped rows sorted head by head; a row that cannot give up as many
    raises before anything is chosen."""
    from hf_paged.errors import PagePoolExhausted
    from hf_paged.head_tables import choose_stacked_victims

    rng = np.random.default_rng(seed)
    layers, rows = 3, 2
    rank = rng.random((layers * rows, heads * width))
    rank[rng.random(rank.shape) < 0.2] = np.inf
    cap = rng.integers(0, width + 1, (layers * rows, heads))
    needs = np.where(rng.random(layers * rows) < 0.8, count, 0)
    needs[0] = count
    alone = [choose_victims(rank[i].reshape(heads, width), cap[i], count) for i in np.flatnonzero(needs)]
    if any(h is None for h, _ in alone):
        with pytest.raises(PagePoolExhausted):
            choose_stacked_victims(rank, cap, needs, heads, width, 8, rows)
        return
    layer_of, table_rows, columns = choose_stacked_victims(rank, cap, needs, heads, width, 8, rows)
    got = sorted(zip(layer_of.tolist(), table_rows.tolist(), columns.tolist()))
    want = sorted((i // rows, (i % rows) * heads + h, c) for i, (hs, cs) in zip(np.flatnonzero(needs), alone)
                  for h, c in zip(hs.tolist(), cs.tolist()))
    assert got == want


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_within_budget_it_equals_dynamic_cache(llama, backend):
    ref, paged = llama
    batch = left_padded_batch((9, 5, 12))
    want = ref.generate(**batch, max_new_tokens=10, **GEN, cache=DynamicCache(config=ref.config),
                        return_dict_in_generate=True, output_scores=True)
    cache = hf_paged.PagedCache(page_size=1, max_pages=22, config=paged.config, per_head_eviction=True,
                                backend=backend)
    got = paged.generate(**batch, max_new_tokens=10, **GEN, cache=cache, return_dict_in_generate=True,
                         output_scores=True)
    assert isinstance(cache, HeadPagedCache) and cache.stats()["evictions"] == 0
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def per_head_case(seed: int = 0, rows: int = 3, group: int = 2, width: int = 11, q_len: int = 1, D: int = 16):
    """Kernel inputs of per-head tables: ``rows`` (row, KV head) tables over a pool of one-head pages, each its own
    kept positions (holes, shuffled order), queries ``[rows, group, q_len, D]`` after them."""
    g = torch.Generator().manual_seed(seed)
    pages = rows * width + 5
    k_pool, v_pool = torch.randn(pages, 1, 1, D, generator=g), torch.randn(pages, 1, 1, D, generator=g)
    ids = torch.randperm(pages, generator=g)[:rows * width].reshape(rows, width)
    pos = torch.stack([torch.randperm(30, generator=g)[:width] for _ in range(rows)])
    ids[torch.rand(rows, width, generator=g) < 0.2] = HOLE
    query = torch.randn(rows, group, q_len, D, generator=g)
    q_pos = torch.arange(30, 30 + q_len).expand(rows, q_len)
    return dict(query=query, k_pool=k_pool, v_pool=v_pool, page_table=ids, page_pos=pos, q_pos=q_pos, scale=0.25)


@pytest.mark.parametrize("signal", ["attention", "output"])
def test_per_head_tables_in_the_c_kernel_match_the_reference(signal):
    if cpu_kernel.unavailable_reason():
        pytest.skip(cpu_kernel.unavailable_reason())
    case = per_head_case()
    want, want_mass = paged_attention_reference(**case, return_page_mass=True, page_mass_signal=signal)
    got, mass = cpu_kernel.paged_attention_cpu(**case, return_page_mass=True, page_mass_signal=signal)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=1e-5, rtol=1e-5)


def test_per_head_tables_in_the_triton_kernel_match_the_reference():
    triton_kernel = pytest.importorskip("hf_paged.kernels.triton_paged_attention")
    case = per_head_case(rows=2, width=5, q_len=2)
    want, want_mass = paged_attention_reference(**case, return_page_mass=True)
    got, mass = triton_kernel.paged_attention_triton(**case, return_page_mass=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mass, want_mass, atol=1e-5, rtol=1e-5)


def test_the_triton_backend_reads_the_per_head_tables_of_the_page_store(llama, monkeypatch):
    """A bounded generate through the Triton kernel (the interpreter on the CPU) reads each (row, KV head) table of
    the layer's store and evicts as SDPA on the gathered head pages does."""
    triton_kernel = pytest.importorskip("hf_paged.kernels.triton_paged_attention")
    _, paged = llama
    batch = left_padded_batch((6,))
    runs, calls, original = {}, [], triton_kernel.paged_attention_triton
    monkeypatch.setattr(triton_kernel, "paged_attention_triton",
                        lambda *a, **k: calls.append(k["k_pool"].shape) or original(*a, **k))
    for backend in ("torch", "triton"):
        cache = hf_paged.PagedCache(page_size=1, max_pages=6, config=paged.config, per_head_eviction=True,
                                    backend=backend, score_signal="attention", sink_pages=1)
        runs[backend] = paged.generate(**batch, max_new_tokens=3, **GEN, cache=cache, return_dict_in_generate=True,
                                       output_scores=True), cache.stats()["evictions"]
    (want, evictions), (got, triton_evictions) = runs["torch"], runs["triton"]
    assert calls and all(shape[1:3] == (1, 1) for shape in calls)  # one-token, one-head pages of the store
    assert evictions > 0 and triton_evictions == evictions
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def kept_by_layer(cache) -> list:
    """Per layer, per table row: the positions it keeps and their scores, in position order."""
    kept = []
    for layer in cache.layers:
        live = layer.table[:, :layer.width] != HOLE
        pos, score = layer.pos[:, :layer.width], layer.score[:, :layer.width]
        rows = [sorted(zip(pos[r][live[r]].tolist(), score[r][live[r]].tolist())) for r in range(layer.rows)]
        kept.append(rows)
    return kept


@pytest.mark.parametrize("rows, floor, decay, signal", [(1, 0.2, None, "attention"), (2, 0.0, 0.5, "output"),
                                                        (2, 1.0, None, "output"), (3, 0.9, None, "attention")])
def test_one_plan_per_step_keeps_what_each_layer_keeps_alone(llama, monkeypatch, rows, floor, decay, signal):
    """A steady decode step planned once for every layer (`HeadTables.plan_step`: one pass ranks, chooses and drops
    every layer's victims, the usage the kernel left in the stacked buffer folded for all layers at the commit) keeps
    the tokens each layer keeps when it plans its own step and folds its usage as it attends, with the same scores and
    the same logits; steps with victims capped by the floor included."""
    from hf_paged.head_eviction import HeadLayer
    from hf_paged.head_tables import HeadTables

    _, paged = llama
    prompt = torch.randint(3, 96, (rows, 14), generator=torch.Generator().manual_seed(rows))
    tokens = torch.randint(3, 96, (rows, 30), generator=torch.Generator().manual_seed(rows + 1))
    planned, plan = [], HeadTables.plan_step

    def run(together: bool):
        if together:
            monkeypatch.setattr(HeadTables, "plan_step", lambda self, *a: planned.append(self.held.sum()) or plan(
                self, *a))
        else:
            monkeypatch.setattr(HeadPagedCache, "_steady", lambda self, keys: False)
            monkeypatch.setattr(HeadLayer, "observed_in_buffer", lambda self: self.observe(
                self.owner.tables.usage[self.layer_idx][:, :self.width].clone()))
        cache = hf_paged.PagedCache(page_size=1, max_pages=10, config=paged.config, per_head_eviction=True,
                                    head_floor=floor, score_decay=decay, score_signal=signal, sink_pages=1,
                                    compress_prompt=True)
        steps = []
        with torch.no_grad():
            logits = [paged(prompt, past_key_values=cache).logits[:, -1]]
            for i in range(tokens.shape[1]):
                logits.append(paged(tokens[:, i:i + 1], past_key_values=cache).logits[:, -1])
                cache.commit()
                steps.append(kept_by_layer(cache))
        monkeypatch.undo()
        check_head_pages(cache)
        within_budget(cache)
        return steps, torch.stack(logits), cache.stats()["evictions"]

    (want, want_logits, want_evictions), (got, got_logits, evictions) = run(False), run(True)
    assert len(planned) == tokens.shape[1] and evictions == want_evictions > 0
    for got_step, want_step in zip(got, want):
        for got_layer, want_layer in zip(got_step, want_step):
            for got_row, want_row in zip(got_layer, want_layer):
                assert [p for p, _ in got_row] == [p for p, _ in want_row]
                np.testing.assert_allclose([v for _, v in got_row], [v for _, v in want_row], rtol=1e-9)
    torch.testing.assert_close(got_logits, want_logits, atol=1e-6, rtol=1e-6)


def test_evicted_head_pages_are_reused_so_memory_stays_at_the_budget(llama):
    """Head pages an eviction frees go back to the layer's block manager and serve the next tokens: the pools stay
    near ``rows × max_pages × kv_heads`` head pages a layer however long the generation (the full cache would hold
    ``rows × tokens × kv_heads``), and ``kv_bytes`` counts the head pages in use."""
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=8, config=paged.config, per_head_eviction=True)
    paged.generate(**left_padded_batch((7, 5)), max_new_tokens=40, **GEN, cache=cache)
    stats, layers = cache.stats(), len(cache.layers)
    heads = cache.layers[0].heads
    in_budget = layers * 2 * 8 * heads
    assert stats["evictions"] > 0 and stats["pages_used"] <= in_budget
    assert stats["pages_total"] <= in_budget  # (the pools grow no further than the budget)
    assert stats["kv_bytes"] == stats["pages_used"] * cache.layers[0].pool.pages.page_bytes()
    check_head_pages(cache)


def test_the_gathered_path_reads_per_head_tables_as_the_reference(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=8, config=paged.config, per_head_eviction=True, sink_pages=1)
    paged.generate(**left_padded_batch((5, 7)), max_new_tokens=14, **GEN, cache=cache)
    layer = cache.layers[1]
    assert (layer.held != layer.held[0]).any()  # the heads kept different numbers of tokens
    torch.manual_seed(0)
    operands = layer.pool.pages.kernel_operands()
    query = torch.randn(layer.rows, 2, 1, operands["k_pool"].shape[-1])
    index = dict(page_table=torch.from_numpy(layer.table[:, :layer.width]),
                 page_pos=torch.from_numpy(layer.pos[:, :layer.width]),
                 q_pos=torch.full((layer.rows, 1), layer.tokens - 1), scale=0.25)
    want, want_mass = paged_attention_reference(query, operands["k_pool"], operands["v_pool"], **index,
                                                return_page_mass=True)
    pools = dict(index, **operands, mask=None, mask_offset=0, sliding_window=None, softcap=None)
    got, usage = gathered_attention(query, layer, pools, cache.policy.__class__.for_pages(1, signal="attention"), True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(usage, want_mass.mean(1), atol=1e-5, rtol=1e-5)


def test_each_row_evicts_its_own_tokens(llama):
    _, paged = llama
    torch.manual_seed(1)
    ids = torch.randint(3, 96, (2, 10))
    kwargs = dict(page_size=1, max_pages=12, config=paged.config, per_head_eviction=True)
    alone = [paged.generate(ids[b:b + 1], max_new_tokens=20, **GEN, cache=hf_paged.PagedCache(**kwargs))
             for b in range(2)]
    cache = hf_paged.PagedCache(**kwargs)
    both = paged.generate(ids, max_new_tokens=20, **GEN, cache=cache)
    assert cache.stats()["evictions"] > 0
    assert torch.equal(both, torch.cat(alone))
    within_budget(cache)
    check_head_pages(cache)


def test_beams_share_head_pages_and_stay_within_budget(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=12, config=paged.config, per_head_eviction=True)
    paged.generate(**left_padded_batch((10, 7)), max_new_tokens=12, num_beams=3, **GEN, cache=cache)
    stats = cache.stats()
    assert stats["evictions"] > 0 and stats["tokens_held"] <= 6 * 12
    assert stats["pages_used"] < 3 * 6 * 12 * 2  # (3 layers, 6 rows of 12 tokens, 2 heads: the beams share)
    within_budget(cache)
    check_head_pages(cache)
    cache.reset()
    assert cache.stats()["pages_used"] == 0 and cache.stats()["pages_free"] == cache.stats()["pages_total"]
    check_head_pages(cache)


def test_a_fork_evicts_on_its_own(llama):
    _, paged = llama
    prompt = left_padded_batch((9,))["input_ids"]
    cache = hf_paged.PagedCache(page_size=1, max_pages=8, config=paged.config, per_head_eviction=True)
    with torch.no_grad():
        paged(prompt[:, :8], past_key_values=cache)
    twin = cache.fork()
    check_head_pages(cache, twin)
    with torch.no_grad():
        for token in (5, 6, 7):
            paged(torch.tensor([[token]]), past_key_values=twin)
    check_head_pages(cache, twin)
    within_budget(twin)
    assert cache.get_seq_length() == 8 and twin.get_seq_length() == 11
    assert cache.layers[0].held.sum() == 8 * cache.layers[0].heads  # the original lost nothing to its fork


def test_a_failed_step_is_rolled_back(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=32, config=paged.config, per_head_eviction=True)
    ids = left_padded_batch((9,))["input_ids"]
    with torch.no_grad():
        paged(ids, past_key_values=cache)
    before = [(layer.table.copy(), layer.held.copy(), layer.pool.manager.num_used) for layer in cache.layers]
    keys = torch.randn(1, 2, 1, 16)
    cache.update(keys, keys, 0)  # one layer wrote the next step, then the forward failed
    assert cache.get_seq_length(0) == 9  # the question of a new forward rolls it back
    for layer, (table, held, in_use) in zip(cache.layers, before):
        assert (layer.table[:, :layer.width] == table[:, :layer.width]).all()
        assert (layer.held == held).all() and layer.pool.manager.num_used == in_use
    check_head_pages(cache)
    with torch.no_grad():
        logits = paged(torch.tensor([[5]]), past_key_values=cache).logits
        full = paged(torch.cat([ids, torch.tensor([[5]])], 1)).logits
    torch.testing.assert_close(logits[0, -1], full[0, -1], atol=1e-4, rtol=1e-4)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(5, 12), prompt=st.integers(1, 12), chunks=st.lists(st.integers(1, 3), min_size=1,
                                                                             max_size=6),
       floor=st.sampled_from([0.0, 0.2, 0.6]), rows=st.integers(1, 2), signal=st.sampled_from(["attention", "output"]))
def test_the_budget_is_never_exceeded(llama, budget, prompt, chunks, floor, rows, signal):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=budget, config=paged.config, per_head_eviction=True,
                                head_floor=floor, score_signal=signal, sink_pages=1)
    torch.manual_seed(budget + prompt)
    with torch.no_grad():
        for length in [min(prompt, budget - 1)] + chunks:
            paged(torch.randint(3, 96, (rows, length)), past_key_values=cache)
            cache.commit()
            within_budget(cache)
            for layer in cache.layers:
                assert layer.held.min() >= min(int(floor * budget), layer.tokens)
    check_head_pages(cache)


def test_compress_prompt_cuts_the_prompt_to_the_budget(llama):
    _, paged = llama
    cache = hf_paged.PagedCache(page_size=1, max_pages=6, config=paged.config, per_head_eviction=True,
                                compress_prompt=True)
    paged.generate(**left_padded_batch((15,)), max_new_tokens=4, **GEN, cache=cache)
    within_budget(cache)
    check_head_pages(cache)
    cache.set_max_pages(None)
    paged.generate(**left_padded_batch((3,)), max_new_tokens=1, **GEN, cache=hf_paged.PagedCache(
        page_size=1, config=paged.config, per_head_eviction=True))


def test_the_evaluation_builds_its_per_head_policy(llama):
    """scripts/evaluation.py's ``score+heads`` policy: the bounded cache it builds (with main's ``cold_format=None``
    among the arguments) is a per-head cache of the job's budget."""
    from hf_paged.evaluation import long_context

    args = Namespace(page_size=1, per_layer_eviction="on", score_decay=None, observation_window=None, score_heads=None,
                     recent_pages=1, score_signal=None, eviction_interval=1)
    cache = long_context.bounded_cache(llama[1], args, "score+heads", "streaming", 16)
    assert isinstance(cache, HeadPagedCache) and cache.max_pages == 16 and cache.policy.name == "score"


@pytest.mark.parametrize("bad, match", [
    (dict(page_size=4), "page_size=1"), (dict(eviction="lru"), "eviction='score'"),
    (dict(kv_format="int8"), "float pages"), (dict(cold_format="int4"), "float pages"),
    (dict(per_layer_eviction=False), "per_layer_eviction"),
    (dict(head_floor=1.5), "head_floor"), (dict(prefix_store="memory://x"), "prefix caching")])
def test_what_per_head_eviction_refuses(bad, match):
    with pytest.raises(CacheUsageError, match=match):
        hf_paged.PagedCache(**{"page_size": 1, "max_pages": 8, "per_head_eviction": True, **bad})


def test_sliding_windows_and_a_lone_head_floor_are_refused():
    with pytest.raises(CacheUsageError, match="sliding-window"):
        hf_paged.PagedCache(page_size=1, max_pages=8, per_head_eviction=True, config=make_config("mistral"))
    with pytest.raises(CacheUsageError, match="head_floor"):
        hf_paged.PagedCache(page_size=1, max_pages=8, head_floor=0.2)
