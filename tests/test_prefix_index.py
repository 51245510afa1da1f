"""The prefix index: events for listeners (a page hashed, evicted, a lookup missed), pages a listener supplies on
a miss, and a hash root that does not depend on the device index."""

from __future__ import annotations

import types

import pytest
import torch

import hf_paged
from hf_paged.block_manager import BlockManager
from hf_paged.page_store import PageStore
from hf_paged.prefix_index import PrefixIndex, PrefixListener, model_fingerprint
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


class Recorder(PrefixListener):
    def __init__(self):
        self.events = []

    def page_hashed(self, index, page, content_hash):
        self.events.append(("hashed", page, content_hash))

    def page_evicted(self, index, page, content_hash):
        self.events.append(("evicted", page, content_hash))

    def run_hashed(self, index, pages, hashes, start, generated):
        self.events.append(("run", list(pages), start))

    def lookup_missed(self, index, hashes, start, end):
        self.events.append(("missed", end - start))


def test_events_follow_a_page_from_its_hash_to_its_eviction():
    manager = BlockManager(page_size=2, max_pages=2)
    index, heard = PrefixIndex(manager), Recorder()
    index.add_listener(heard)
    a, b = manager.allocate(), manager.allocate()
    index.register_pages([a, b], [b"ha", b"hb"], 0, 0, 2)
    manager.release_row([a, b])  # both stay cached (hashed), b evicted first (tail first)
    assert heard.events == [("hashed", a, b"ha"), ("hashed", b, b"hb"), ("run", [a, b], 0)]
    assert index.cached_run([b"ha", b"hb", b"hc"]) == [a, b] and heard.events[-1] == ("missed", 1)
    assert manager.allocate() == b and heard.events[-1] == ("evicted", b, b"hb")  # taken for reuse
    assert index.cached_run([b"ha", b"hb"]) == [a] and heard.events[-1] == ("missed", 1)


def test_a_listener_supplies_the_pages_a_lookup_misses():
    """A tier that holds K/V by hash loads them into fresh pages through the page store; the lookup then finds
    them (one listener call per lookup)."""
    manager, store = BlockManager(page_size=2, initial_pages=4), PageStore(page_size=2)  # (free pages: loading
    # into a full pool takes the least recently used cached page, which may be one just loaded)
    pages = store.create(0, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))
    index = PrefixIndex(manager, store)
    tier = {b"h0": torch.full((2, 1, 4), 3.0), b"h1": torch.full((2, 1, 4), 5.0)}

    class Tier(PrefixListener):
        calls = 0

        def lookup_missed(self, index, hashes, start, end):
            Tier.calls += 1
            run = [h for h in hashes[start:end] if h in tier]

            def write(rows, pages):
                index.store.layers[0].grow_to(manager.num_pages)
                for row, page in zip(rows, pages):
                    index.store.layers[0].write(torch.arange(page * 2, page * 2 + 2), tier[run[row]], -tier[run[row]])
            assert index.load_run(run, write) == 2

    index.add_listener(Tier())
    run = index.cached_run([b"h0", b"h1", b"h2"])
    assert len(run) == 2 and Tier.calls == 1 and manager.num_used == 0 and len(manager.cached) == 2
    keys, values = pages.gather(torch.tensor(run))
    assert torch.equal(keys[0], tier[b"h0"]) and torch.equal(values[1], -tier[b"h1"])
    manager.check_invariants()


def test_the_fingerprint_ignores_the_device_index_but_not_the_device_type():
    _, model = make_pair("llama")

    def on(device: str):
        params = [(name, types.SimpleNamespace(shape=p.shape, dtype=p.dtype, device=torch.device(device),
                                               detach=p.detach)) for name, p in model.named_parameters()]
        return types.SimpleNamespace(config=model.config, named_parameters=lambda: iter(params))

    roots = {d: model_fingerprint(on(d), 16, [None]) for d in ("cuda:0", "cuda:1", "cpu")}
    assert roots["cuda:0"] == roots["cuda:1"] != roots["cpu"]


def test_generate_many_registers_pages_through_the_index_and_tells_listeners():
    _, paged = make_pair("llama")
    cache = hf_paged.RaggedCache(paged.config, page_size=4)
    heard = Recorder()
    cache.prefix.add_listener(heard)
    prompt = list(range(5, 15))  # 10 tokens: 2 full prompt pages
    hf_paged.generate_many(paged, [prompt], max_new_tokens=3, cache=cache, progress=False)
    hashed = [e for e in heard.events if e[0] == "hashed"]
    assert len(hashed) == 3 and len(cache.manager.page_hash) == 3  # 13 tokens computed: 3 full pages
    hf_paged.generate_many(paged, [prompt], max_new_tokens=1, cache=cache, progress=False)
    assert cache.prefix_hits == 2  # the prompt's 2 full pages, found through the index


def test_a_run_of_pages_goes_out_of_the_store_and_back_into_fresh_pages():
    """What a prefix store outside the pool needs: the pages' specs over layers, a run of pages copied out
    (`read_pages`) and loaded into fresh pages of another pool under their hashes (`load_run`), cached."""
    store = PageStore(page_size=2)
    for layer, heads in ((0, 1), (1, 2)):
        pages = store.create(layer, torch.zeros(1, heads, 1, 4), torch.zeros(1, heads, 1, 3))
        pages.grow_to(3)
        pages.write(torch.arange(6), torch.randn(6, heads, 4), torch.randn(6, heads, 3))
    assert store.page_specs([0, 1]) == {"k_pool.0": ((2, 1, 4), torch.float32), "v_pool.0": ((2, 1, 3), torch.float32),
                                        "k_pool.1": ((2, 2, 4), torch.float32), "v_pool.1": ((2, 2, 3), torch.float32)}
    tensors = store.read_pages(torch.tensor([2, 0]), [0, 1])
    manager, other = BlockManager(page_size=2, initial_pages=4), PageStore(page_size=2)
    for layer, heads in ((0, 1), (1, 2)):
        other.create(layer, torch.zeros(1, heads, 1, 4), torch.zeros(1, heads, 1, 3))
    index = PrefixIndex(manager, other)

    def write(rows, pages):
        at = torch.tensor(rows)
        other.write_pages(torch.tensor(pages), [0, 1], {name: t[at] for name, t in tensors.items()},
                          manager.num_pages)

    assert index.load_run([b"a", b"b"], write) == 2
    loaded = index.cached_run([b"a", b"b"])
    assert len(loaded) == 2 and len(manager.cached) == 2 and manager.num_used == 0
    back = other.read_pages(torch.tensor(loaded), [0, 1])
    assert sorted(back) == sorted(tensors) and all(torch.equal(back[name], tensors[name]) for name in tensors)


def test_listener_counters_join_the_cache_stats():
    class Counting(PrefixListener):
        def stats(self):
            return {"store_hits": 3}

    cache = hf_paged.PagedCache(page_size=4)
    cache.update(torch.zeros(1, 1, 5, 2), torch.zeros(1, 1, 5, 2), 0)
    next(iter(cache.groups.values())).prefix.add_listener(Counting())
    assert cache.stats()["store_hits"] == 3
