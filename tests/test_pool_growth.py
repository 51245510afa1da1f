"""An unbounded pool reuses its cached pages before it grows (issue 30, item 4): 300 x (reset, generate) with a
shared system prompt grew a bound cache from 4 to 571 pages while at most 4 were in use. Here the same loop at 50
calls (the 300-call soak, with RSS, is ``scripts/soak_prefix_reuse.py``), and the block manager's rules."""

import pytest
import torch

import hf_paged
from hf_paged.block_manager import BlockManager
from hf_paged.ragged_cache import RaggedCache
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_reset_and_generate_with_a_shared_prompt_keeps_the_pool_flat():
    ref, paged = make_pair("llama")
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 96, (40,), generator=g).tolist()
    cache = hf_paged.PagedCache(page_size=16, model=paged)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    totals, used = [], []
    for _ in range(50):
        cache.reset()
        prompt = torch.tensor([system + torch.randint(3, 96, (5,), generator=g).tolist()])
        out = paged.generate(prompt, **kwargs, cache=cache)
        stats = cache.stats()
        totals.append(stats["pages_total"])
        used.append(stats["pages_used"])
    assert torch.equal(out, ref.generate(prompt, **kwargs))
    assert stats["prefix_hits"] >= 2 * 49  # the system prompt's two full pages, reused by every later call
    peak = max(used)
    assert max(totals) <= peak + peak // 4 + 1, (totals, peak)  # what is in use, plus one growth step at most
    assert totals[-1] == totals[4], totals  # flat


def test_generate_many_reusing_a_cache_keeps_the_pool_flat():
    _, paged = make_pair("llama")
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 96, (40,), generator=g).tolist()
    cache = RaggedCache(paged.config, page_size=8)
    totals = []
    for _ in range(20):
        prompts = [system + torch.randint(3, 96, (n,), generator=g).tolist() for n in (3, 9)]
        hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache, progress=False)
        totals.append(cache.manager.num_pages)
    assert totals[-1] == totals[2], totals
    assert cache.prefix_hits >= 5 * 2 * 19


def hashed_cached_pages(manager: BlockManager, pages: list[int]) -> None:
    """Make ``pages`` (allocated) cached: hashed, then released."""
    for page in pages:
        manager.set_hash(page, f"content of {page}".encode())
        manager.release(page)


def test_allocate_takes_a_cached_page_before_growing_into_the_preferred_one():
    manager = BlockManager(page_size=4)
    pages = [manager.allocate() for _ in range(4)]
    assert manager.num_pages == 4 and not manager.free
    hashed_cached_pages(manager, pages[:2])
    page = manager.allocate(prefer=manager.num_pages)  # just beyond the pool: only growth could give it
    assert page == pages[0] and manager.num_pages == 4  # the least recently used cached page, no growth
    manager.check_invariants()


def test_free_run_prefers_a_free_run_then_reuses_cached_pages_then_grows():
    manager = BlockManager(page_size=4, initial_pages=8)
    pages = [manager.allocate() for _ in range(8)]
    for p in (1, 2, 3):
        manager.release(pages[p])  # a free run of 3
    hashed_cached_pages(manager, [pages[5], pages[7]])
    assert manager.free_run(3) == 1  # the slab fast path: a run of free pages
    assert manager.free_run(5) is None and manager.num_pages == 8  # 3 free + 2 cached hold 5: no growth
    assert manager.free_run(6) == 8 and manager.num_pages >= 14  # they cannot: the pool grows for the run
    manager.check_invariants()


def test_soak_script_runs_and_records_pages_and_rss(tmp_path):
    """`scripts/soak_prefix_reuse.py` (the 300-call soak) at a few calls of the tiny model: its records and plot."""
    from hf_paged.evaluation import soak
    from script_commands import Command

    result = Command("soak_prefix_reuse", soak).main(["--model", "tiny", "--calls", "6", "--every", "3",
                                                      "--no-progress", "--out", str(tmp_path)])
    rows, summary = result["rows"], result["summary"]
    assert [r["call"] for r in rows] == list(range(1, 7)) and all(r["rss_mib"] > 0 for r in rows)
    assert summary["pages_total_max"] <= summary["peak_pages_used"] + summary["peak_pages_used"] // 4 + 1
    assert all((tmp_path / f"soak.{ext}").is_file() for ext in ("md", "json", "png"))
