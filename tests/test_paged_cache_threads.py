"""A `PagedCache` serves one thread (issue 11, item 7); the same rule for `RaggedCache` is in
test_ragged_ownership.py."""

from __future__ import annotations

import pytest


def test_a_cache_used_by_a_second_thread_raises_a_clear_error():
    """Concurrently (two threads start together) or one after the other: the thread that does not own the
    cache gets a CacheUsageError, and the owner's tokens are those of a cache of its own."""
    import threading

    import torch

    import hf_paged
    from tiny_models import left_padded_batch, make_pair

    _, model = make_pair("llama")
    batch = left_padded_batch((9, 5))
    kwargs = dict(max_new_tokens=12, do_sample=False)
    want = model.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: hf_paged.PagedCache(page_size=4)})

    shared = hf_paged.PagedCache(page_size=4)
    start, results = threading.Barrier(2), {}

    def run(name):
        start.wait()
        try:
            results[name] = model.generate(**batch, **kwargs, **{hf_paged.CACHE_KWARG: shared})
        except hf_paged.CacheUsageError as error:
            results[name] = error

    threads = [threading.Thread(target=run, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results.values() if isinstance(r, Exception)]
    outputs = [r for r in results.values() if not isinstance(r, Exception)]
    assert len(errors) == 1 and "serves one thread" in str(errors[0])
    assert len(outputs) == 1 and torch.equal(outputs[0], want)

    with pytest.raises(hf_paged.CacheUsageError, match="serves one thread"):
        model(**batch, **{hf_paged.CACHE_KWARG: shared})  # this (main) thread never owned it
