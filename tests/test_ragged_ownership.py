"""Who may use a `RaggedCache` (issue 30, items 3 and 9): one thread at a time, with `PagedCache`'s rule and error
(two threads sharing one gave a shape error to one and silently wrong tokens to the other); one `generate_many`
run at a time (a `stream_many` generator kept after ``break`` holds its rows: the next run is told why and what
to do, where it got "sequence 0 is already in the cache").
"""

import gc
import threading

import pytest

import hf_paged
from hf_paged.ragged_cache import RaggedCache
from test_generate_many import generate_each, random_prompts
from tiny_models import make_pair

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return make_pair("llama")


def test_a_ragged_cache_used_by_a_second_thread_raises_a_clear_error(llama):
    """Two threads start generate_many on one cache together: the one that does not hold it gets PagedCache's
    error, the other the tokens of a cache of its own; afterwards (the run ended) any thread may use it."""
    ref, paged = llama
    prompts = random_prompts((9, 14, 5), seed=6)
    want = generate_each(ref, prompts, [6] * 3, eos_token_id=None)
    shared = RaggedCache(paged.config, page_size=4)
    start, refused, results = threading.Barrier(2), threading.Event(), {}

    def hold_until_the_other_was_refused(module, args, kwargs):  # the holder's run overlaps the other's start
        refused.wait(timeout=10)

    handle = paged.register_forward_pre_hook(hold_until_the_other_was_refused, with_kwargs=True)

    def run(name):
        start.wait()
        try:
            results[name] = hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=shared,
                                                   progress=False)
        except hf_paged.CacheUsageError as error:
            results[name] = error
            refused.set()

    try:
        threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        handle.remove()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    outputs = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(errors) == 1 and "this RaggedCache holds the tokens of thread" in str(errors[0])
    assert "serves one thread" in str(errors[0]) and "its own RaggedCache" in str(errors[0])
    assert outputs == [want]
    assert hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=shared,
                                  progress=False) == want  # this (main) thread, after the run ended
    shared.manager.check_invariants()


def test_a_paused_run_in_another_thread_keeps_the_cache(llama):
    _, paged = llama
    cache = RaggedCache(paged.config, page_size=4)
    stream = hf_paged.stream_many(paged, [[5, 6, 7]], max_new_tokens=4, cache=cache, progress=False)
    worker = threading.Thread(target=lambda: next(stream))
    worker.start()
    worker.join()
    with pytest.raises(hf_paged.CacheUsageError, match="serves one thread"):
        hf_paged.generate_many(paged, [[8, 9]], max_new_tokens=2, cache=cache, progress=False)


def start_and_leave(paged, cache, prompts):
    """A loop that breaks out of stream_many after its first token, keeping the generator."""
    stream = hf_paged.stream_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache, progress=False)
    for _ in stream:
        break
    return stream


@pytest.mark.parametrize("then", ["close", "drop", "reset"])
def test_a_generator_kept_after_break_is_named_and_the_cache_recovers(llama, then):
    ref, paged = llama
    prompts = random_prompts((9, 14), seed=8)
    want = generate_each(ref, prompts, [6, 6], eos_token_id=None)
    cache = RaggedCache(paged.config, page_size=4)
    stream = start_and_leave(paged, cache, prompts)
    assert cache.sequences  # the paused run holds its rows
    with pytest.raises(hf_paged.CacheUsageError, match=r"unfinished generate_many run.*break.*\.close\(\)"):
        hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache, progress=False)
    if then == "close":
        stream.close()
    elif then == "drop":
        del stream
        gc.collect()
    else:
        cache.reset()
        with pytest.raises(hf_paged.CacheUsageError, match="was reset"):
            next(stream)  # its rows are gone: resuming it is refused, not silently wrong
    assert cache.sequences == {} and cache.manager.num_used == 0
    assert hf_paged.generate_many(paged, prompts, max_new_tokens=6, eos_token_id=[], cache=cache,
                                  progress=False) == want
    cache.manager.check_invariants()


def test_a_paused_generator_resumed_after_another_run_took_the_cache_stops(llama):
    ref, paged = llama
    prompts = random_prompts((9, 14), seed=8)
    cache = RaggedCache(paged.config, page_size=4)
    first = start_and_leave(paged, cache, prompts)
    cache.reset()
    second = start_and_leave(paged, cache, prompts[::-1])
    with pytest.raises(hf_paged.CacheUsageError, match="was reset"):
        next(first)  # it must not step the rows of the second run, nor release them
    rest = list(second)
    assert len(rest) == 2 * 6 - 1 and cache.sequences == {} and cache.manager.num_used == 0
