"""The background writer: writes on one thread, bounded queue, flush/close that wait, errors as one warning."""

import threading
import warnings

import pytest
from prefix_store_cases import chain, joined, layout, pages, same_pages, store_warnings

from hf_paged.prefix_store import BackgroundWriter, DiskStore


class Gated(DiskStore):
    """A folder store whose writes wait for ``gate`` and record the thread they ran on."""

    def __init__(self, root):
        super().__init__(root)
        self.gate = threading.Event()
        self.threads = set()

    def put(self, *args, **kwargs):
        self.gate.wait()
        self.threads.add(threading.current_thread().name)
        return super().put(*args, **kwargs)


def test_writes_run_on_the_writer_thread_and_flush_waits(tmp_path):
    store = Gated(tmp_path)
    writer = BackgroundWriter(store, max_pending=4)
    lay = layout("run")
    hashes, tensors = chain(8), pages(lay, 8)
    assert writer.put(lay, hashes, tensors) == 8
    assert writer.contains_prefix(lay, hashes) == 0  # queued, not written yet
    store.gate.set()
    writer.flush()
    assert writer.contains_prefix(lay, hashes) == 8 and same_pages(joined(writer.get(lay, hashes)), tensors)
    assert store.threads == {"hf_paged-store-writer"}
    assert writer.stats()["store_pages_written"] == 8 and writer.stats()["store_pending_writes"] == 0
    writer.close()
    writer.close()  # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        writer.put(lay, hashes, tensors)


def test_the_queue_is_bounded_and_close_writes_what_is_queued(tmp_path):
    store = Gated(tmp_path)
    writer = BackgroundWriter(store, max_pending=2)
    lay = layout("page")
    for seed in range(3):  # one taken by the thread (waiting at the gate), two queued
        writer.put(lay, chain(1, seed), pages(lay, 1, seed))
    blocked = threading.Thread(target=writer.put, args=(lay, chain(1, 3), pages(lay, 1, 3)))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # the queue is full: the caller waits instead of growing memory
    store.gate.set()
    blocked.join()
    writer.close()
    reopened = DiskStore(tmp_path)
    assert all(reopened.contains_prefix(lay, chain(1, seed)) == 1 for seed in range(4))


def test_bad_input_raises_in_the_caller(tmp_path):
    writer = BackgroundWriter(DiskStore(tmp_path))
    lay = layout("run")
    with pytest.raises(ValueError, match="shape"):
        writer.put(lay, chain(3), pages(lay, 2))
    with pytest.raises(ValueError, match="first"):
        writer.put(lay, chain(2), pages(lay, 2), first=-1)
    with pytest.raises(ValueError, match="max_pending"):
        BackgroundWriter(DiskStore(tmp_path), max_pending=0)
    writer.close()


class Failing(DiskStore):
    def put(self, layout, hashes, tensors, first=0):
        if first == 0:
            raise RuntimeError("boom")
        return super().put(layout, hashes, tensors, first)


def test_a_failing_write_is_one_warning_and_the_thread_goes_on(tmp_path):
    writer = BackgroundWriter(Failing(tmp_path))
    lay = layout("page")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            writer.put(lay, chain(2), pages(lay, 2))
        writer.put(lay, chain(2)[1:], pages(lay, 1, first=1), first=1)
        writer.flush()
    assert len(store_warnings(caught)) == 1 and "RuntimeError: boom" in store_warnings(caught)[0]
    assert writer.stats()["store_errors"] == 3 and writer.stats()["store_pages_written"] == 1
    writer.close()
