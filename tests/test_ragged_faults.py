"""An interrupt anywhere in the continuous-batching bookkeeping (issue 30, item 7): 11 of 151 spots (e.g. right
after `release_sequence`) left the `RaggedCache` broken for good ("sequence 1 is already in the cache", "page
lost"). Here every call of every bookkeeping method of one run raises KeyboardInterrupt in turn (the k-th call,
once); the same cache must then serve the next run, exactly, with its pages accounted for; `reset()` must restore
it too."""

from __future__ import annotations

import contextlib

import pytest

import hf_paged
from hf_paged.block_manager import BlockManager
from hf_paged.generation_options import GenerationOptions
from hf_paged.ragged_cache import RaggedCache
from hf_paged.scheduler import Scheduler
from hf_paged.stats import GenerationStats
from test_generate_many import random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")

BOOKKEEPING = {
    BlockManager: ("allocate", "release", "share", "release_row", "share_row", "set_hash", "lookup", "forget",
                   "require", "available", "grow_to", "release_all", "_drop_hash"),
    RaggedCache: ("claim", "unclaim", "holds", "cached_prefix", "add_sequence", "fork_sequence", "release_sequence",
                  "hash_pages", "step_pages", "begin_step", "finish_step", "abort_step", "_clear"),
    Scheduler: ("schedule", "_admit", "_cached_pages", "_waits_for_prefix", "pages_for", "fork_pages", "plan",
                "after_step", "_hash_full_pages", "fork_followers", "retire"),
    GenerationOptions: ("next_token", "finish_reason"),
    GenerationStats: ("admitted", "step", "token", "finished"),
}


class Interrupt:
    """Counts calls of the bookkeeping methods; the ``at``-th call (1-based, once) raises KeyboardInterrupt."""

    def __init__(self, at: int | None = None):
        self.at, self.calls, self.where = at, 0, None

    @contextlib.contextmanager
    def patched(self):
        saved = []
        for owner, names in BOOKKEEPING.items():
            for name in names:
                real = owner.__dict__[name]
                saved.append((owner, name, real))
                setattr(owner, name, self._wrap(real, f"{getattr(owner, '__name__', owner)}.{name}"))
        try:
            yield self
        finally:
            for owner, name, real in saved:
                setattr(owner, name, real)

    def _wrap(self, real, where):
        def call(*args, **kwargs):
            self.calls += 1
            if self.calls == self.at:
                self.where = where
                raise KeyboardInterrupt(f"call {self.at}: {where}")
            return real(*args, **kwargs)
        return call


@pytest.fixture(scope="module")
def workload():
    """A system prompt shared by three prompts (one repeated), two samples each, through a pool of four rows."""
    _, paged = make_pair("llama")
    system = random_prompts((9,), seed=3)[0]
    a, b = (system + p for p in random_prompts((3, 6), seed=4))
    prompts = [a, b, a]
    kwargs = dict(max_new_tokens=[5, 3, 4], do_sample=True, num_return_sequences=2, seed=1, eos_token_id=[],
                  max_batch_tokens=16, progress=False)

    def run(cache):
        return hf_paged.generate_many(paged, prompts, cache=cache, **kwargs)

    def new_cache():
        return RaggedCache(paged.config, page_size=4, max_pages=24)

    return paged, run, new_cache


def check_usable(cache: RaggedCache, run, want) -> None:
    assert run(cache) == want, "the next run is not exact"
    assert cache.sequences == {} and cache.step is None and cache.manager.num_used == 0
    cache.manager.check_invariants()


def test_an_interrupt_at_every_bookkeeping_call_leaves_a_usable_cache(workload):
    _, run, new_cache = workload
    counter = Interrupt()
    with counter.patched():
        want = run(new_cache())
    assert counter.calls > 150, counter.calls  # the spots covered
    broken = []
    for at in range(1, counter.calls + 1):
        cache = new_cache()
        with Interrupt(at).patched() as interrupt:
            try:
                run(cache)
            except KeyboardInterrupt:
                pass
            except Exception as error:  # noqa: BLE001 (the clean-up of the interrupted run failed)
                broken.append(f"{interrupt.where}: the interrupted run raised {type(error).__name__}: {error}")
                continue
        try:
            check_usable(cache, run, want)  # as it is: the failed run gave everything back
            cache.reset()
            check_usable(cache, run, want)  # after reset: the cached prefix pages are reused, exactly
        except Exception as error:  # noqa: BLE001 (collected: the report names every spot)
            broken.append(f"{interrupt.where}: {type(error).__name__}: {error}")
    assert not broken, f"{len(broken)} of {counter.calls} spots:\n" + "\n".join(broken[:20])


def test_an_interrupt_in_the_clean_up_is_mended_by_the_next_run(workload):
    """A run is closed early and the clean-up that releases its rows is interrupted: its rows are left behind.
    The next run finds them (their run has ended) and drops them, as `reset()` would."""
    paged, run, new_cache = workload
    cache = new_cache()
    real = RaggedCache._clear

    def interrupted_clear(self):
        self.user = None  # a clean-up interrupted after its first statement
        raise KeyboardInterrupt

    RaggedCache._clear = interrupted_clear
    try:
        stream = hf_paged.stream_many(paged, [[5, 6, 7, 8, 9]], max_new_tokens=3, cache=cache, progress=False)
        next(stream)
        with pytest.raises(KeyboardInterrupt):
            stream.close()
    finally:
        RaggedCache._clear = real
    assert cache.sequences  # left behind
    want = run(new_cache())
    check_usable(cache, run, want)

