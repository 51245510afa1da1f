"""A failed step (issue 11, item 5): after a layer raises mid-step, the cache holds and reports the state before
the step, and a retry is exact."""

from __future__ import annotations

import pytest


class Boom(RuntimeError):
    pass


def _decode(model, cache, batch, steps, fail_at=None, fail_in=None):
    """Manual decode loop (prompt, then ``steps`` greedy tokens); step ``fail_at`` first fails once in
    ``fail_in(model, cache)`` (a context manager), and the test checks the cache reports the state before it."""
    import torch

    import hf_paged

    def state():
        stats = cache.stats()
        return (cache.get_seq_length(), [cache.get_mask_sizes(1, i) for i in range(len(cache.layers))],
                stats["tokens_stored"], stats["pages_used"], stats["evictions"], stats["page_size"])

    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = []
    for step in range(steps + 1):
        if step == fail_at:
            before = state()
            with pytest.raises(Boom), fail_in(model, cache):
                model(input_ids=ids, attention_mask=mask, **{hf_paged.CACHE_KWARG: cache})
            after = state()
            evicted = after[4] - before[4]  # the step's evictions stand (full pages); nothing else changes
            assert after[:2] == before[:2] and after[5] == before[5]
            assert (after[2], after[3]) == (before[2] - evicted * before[5], before[3] - evicted)
            if cache.token_log is not None:
                assert all(len(row) == before[0] for row in cache.token_log.tokens)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, **{hf_paged.CACHE_KWARG: cache}).logits[:, -1]
        logits.append(out)
        ids = out.argmax(-1, keepdim=True)
        mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    return torch.stack(logits)


class _fail_after_layer:
    """Raise in the MLP of decoder layer ``index`` (after its attention wrote the cache), once."""

    def __init__(self, index):
        self.index = index

    def __call__(self, model, cache):
        self.layer = model.model.layers[self.index].mlp
        return self

    def __enter__(self):
        def hook(module, args):
            self.handle.remove()
            raise Boom("injected failure")

        self.handle = self.layer.register_forward_pre_hook(hook)

    def __exit__(self, *exc):
        self.handle.remove()


class _fail_in_update:
    """Raise inside `PagedCache.update` of layer ``index`` (its group already planned the step), once."""

    def __init__(self, index):
        self.index = index

    def __call__(self, model, cache):
        self.layer = cache.layers[self.index]
        return self

    def __enter__(self):
        real = self.layer.update

        def update(*args, **kwargs):
            real(*args, **kwargs)
            raise Boom("injected failure")

        self.layer.update = update

    def __exit__(self, *exc):
        del self.layer.update


@pytest.mark.parametrize("kind", ["config", "model", "per_layer", "evicting", "evicting_every_step"])
@pytest.mark.parametrize("arch,fail", [("llama", _fail_after_layer(1)), ("llama", _fail_in_update(1)),
                                       ("gemma3", _fail_after_layer(2)), ("gemma3", _fail_in_update(2))])
def test_failed_step_is_rolled_back_at_once_and_a_retry_is_exact(arch, fail, kind):
    """After a layer raises mid-step the cache reports and holds the state before the step (both groups
    of a hybrid model, or every layer's group of a per-layer bounded cache), and retrying gives the logits
    of a run without the failure. "evicting": a full pool of one-token pages, where every decode step
    evicts (a victim's page takes the new token in place, `recycle_plan`); the evictions of a failed step
    stand, so its retry attends what the step would have. The default queues 8 victims at a time
    (`eviction_interval`): a retry keeps the failed step's queue, before, at the end of and after a queue;
    "evicting_every_step" chooses a victim every step (``eviction_interval=1``)."""
    import torch

    import hf_paged
    from tiny_models import left_padded_batch, make_pair

    _, model = make_pair(arch)
    batch = left_padded_batch((9, 5))

    def cache():
        kwargs = {"config": dict(config=model.config), "model": dict(model=model),
                  "per_layer": dict(config=model.config, max_pages=64, eviction="score"),
                  "evicting": dict(config=model.config, max_pages=18, eviction="score", page_size=1),
                  "evicting_every_step": dict(config=model.config, max_pages=18, eviction="score", page_size=1,
                                              eviction_interval=1)}[kind]
        return hf_paged.PagedCache(**{"page_size": 4, **kwargs})

    evicting = kind.startswith("evicting")
    steps, fails = (12, (1, 3, 8, 9, 11)) if evicting else (4, (1, 3))
    clean_cache = cache()
    clean = _decode(model, clean_cache, batch, steps=steps)
    assert (clean_cache.stats()["evictions"] > 0) == evicting  # 2 rows x 9 tokens fill 18 pages
    for fail_at in fails:
        retried = _decode(model, cache(), batch, steps=steps, fail_at=fail_at, fail_in=fail)
        torch.testing.assert_close(retried, clean, rtol=0, atol=1e-5)


def test_a_retry_takes_the_failed_step_s_queue_only_where_its_rows_hold_it():
    """`GroupEviction.hold_queue` keeps a rolled-back step's queue as (page, position) pairs; the first plan after
    the rollback carries it, in its own columns, only when it is the same step (position, length) and each row
    still holds every queued page at its position: not after the rows were swapped or the step changed."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from hf_paged.eviction import EvictionPolicy, GroupEviction

    def plan(table, positions, past=6, victims=None):
        return SimpleNamespace(past=past, q_len=1, victims=victims, read_table=torch.tensor(table),
                               read_pos=torch.tensor(positions), slots=torch.tensor([30, 31]), page_size=1)

    failed = plan([[10, 11, 12, 13], [20, 21, 22, 23]], [[0, 2, 4, 6], [0, 2, 4, 6]],
                  victims=np.array([[1, 2], [2, 1]]))  # (row 0 queues pages 11, 12; row 1 pages 22, 21)
    rows = [([13, -1, 12, 11, 10], [6, 7, 4, 2, 0]), ([23, 22, 21, 20, -1], [6, 4, 2, 0, 7])]  # (other columns, holes)
    for retry, expected in ((plan(*zip(*rows)), [[3, 2], [1, 2]]), (plan(*zip(*rows[::-1])), None),
                            (plan(*zip(*rows), past=7), None)):
        eviction = GroupEviction(EvictionPolicy.for_pages(1), True)
        eviction.hold_queue(failed)
        eviction.planned(retry)
        assert (None if retry.victims is None else retry.victims.tolist()) == expected
        assert eviction.held_queue is None  # (consulted once)
