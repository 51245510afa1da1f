"""Property tests of page sharing on bare caches, and the regressions they found.

The state machines drive random forks / writes / row reorders / crops / drops / resets on bare 2-layer
caches (both layers full attention, or one sliding-window layer and one full) and check that every row
of every live cache reads back exactly what was written to that row, and the page accounting: the
BlockManager invariants, one reference per page entry of a row, pages given back once dropped.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hf_paged
from page_checks import check_all_given_back, check_pages
from tiny_models import hybrid_cache_config, shared_pair

pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------- regressions the property tests found
def _write_tags(cache, tags: list[int]) -> list[float]:
    """One step of one row into a 1-layer cache, every key / value equal to its tag; returns what the row reads."""
    t = torch.tensor([tags], dtype=torch.float32)[:, None, :, None]
    cache.update(t, t, 0)
    return cache.layers[0].read()[0][0, :, 0, 0].tolist()


def test_row_moved_to_a_new_slab_in_a_copy_on_write_step_keeps_its_tokens():
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
    assert _write_tags(a, [2, 3]) == [1.0, 2.0, 3.0]


def test_rows_identical_in_the_first_layer_only_get_their_own_pages():
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


def test_identical_prompts_with_different_masks():
    """A fresh batch of identical tokens with different masks: layer 0 rows match, later ones do not."""
    ref, paged = shared_pair("llama")
    ids = torch.tensor([[5, 6, 7, 8]] * 3)
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1]])
    cache = hf_paged.PagedCache(page_size=1, config=paged.config)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask).logits
        got = paged(input_ids=ids, attention_mask=mask, cache=cache).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)
    check_pages(cache)


# ------------------------------------------------------------------------ the state machines
H, D, LAYERS, MAX_ROWS = 1, 2, 2, 4


def _kv(tags: list[list[int]], layer: int):
    """Keys [B, H, q, D] whose every entry is the token's tag (+ layer / 4); values are their negation."""
    t = torch.tensor(tags, dtype=torch.float32) + 0.25 * layer
    keys = t[:, None, :, None].expand(-1, H, -1, D).contiguous()
    return keys, -keys


def _peek(cache, layer_idx: int):
    """A layer's rows, read from its pages through the page tables, without a new step."""
    layer = cache.layers[layer_idx]
    group = layer.group
    B, S = len(group.rows), group.page_size
    table = torch.tensor(group.rows, dtype=torch.long).reshape(B, -1)
    T = group.num_tokens - group.first_page * S
    keys, values = layer.pages.gather(table)
    return keys.reshape(B, -1, H, D)[:, :T], values.reshape(B, -1, H, D)[:, :T]


class _SharingRules(RuleBasedStateMachine):
    """Caches that share pages (forks of roots) against a model: per cache, per row, per layer, the tags.

    ``window``: None, both layers keep every token (one page group); else layer 0 is a sliding-window
    layer (its own group and BlockManager, pages freed as they leave the window) and layer 1 full.
    """

    def _setup(self, page_size: int, window: int | None):
        self.page_size, self.window = page_size, window
        self.config = None if window is None else hybrid_cache_config(window)
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
        if limit < n < N:  # the cache must refuse, and change nothing (cropping every token always empties it)
            with pytest.raises(hf_paged.CacheUsageError):
                self.caches[cid].crop(-n)
            return
        self.caches[cid].crop(-n)
        if n == N:  # every token: the cache is empty, its rows gone (as after reset), as DynamicCache.crop empties
            self.model[cid] = None
            return
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
