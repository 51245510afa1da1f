"""Load or recompute: the measured read bandwidth and the decision, and the counter of skipped loads."""

import pytest
from prefix_store_cases import chain, layout, pages

from hf_paged.prefix_store import DiskStore, ReadBandwidth, decide
from hf_paged.prefix_store.load_policy import LoadPolicy


def test_decision_compares_estimated_load_and_prefill_times():
    fast = decide(1e9, nbytes=100_000_000, tokens=100, prefill_tokens_per_s=500)  # 0.1 s against 0.2 s
    assert fast.load and fast.load_seconds == pytest.approx(0.1) and fast.recompute_seconds == pytest.approx(0.2)
    slow = decide(1e8, nbytes=100_000_000, tokens=100, prefill_tokens_per_s=500)  # 1 s against 0.2 s
    assert not slow.load and "recomputing" in slow.reason
    assert decide(1e8, 100_000_000, 100, 500, probe=True).load
    unmeasured = decide(None, 100_000_000, 100, 500)
    assert unmeasured.load and unmeasured.load_seconds is None and "measure" in unmeasured.reason
    assert decide(1e8, 100_000_000, 100, None).load
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        decide(1e8, 1, 1, 0)
    with pytest.raises(ValueError, match="nbytes and tokens"):
        decide(1e8, -1, 1, 1)


def test_bandwidth_follows_the_reads():
    bandwidth = ReadBandwidth(decay=0.5)
    assert bandwidth.bytes_per_second is None
    bandwidth.record(0, 1.0)
    bandwidth.record(10, 0.0)
    assert bandwidth.bytes_per_second is None
    bandwidth.record(1_000_000, 0.01)
    assert bandwidth.bytes_per_second == pytest.approx(1e8)
    for _ in range(20):  # the disk became ten times slower
        bandwidth.record(1_000_000, 0.1)
    assert bandwidth.bytes_per_second == pytest.approx(1e7, rel=1e-4)
    with pytest.raises(ValueError, match="decay"):
        ReadBandwidth(decay=1.0)


def test_a_streak_of_recomputes_ends_with_one_load_that_measures_again():
    policy = LoadPolicy(probe_every=3)
    policy.bandwidth.record(1_000_000, 1.0)  # 1 MB/s: loading 10 MB takes 10 s, prefill 0.1 s
    choices = [policy.decide(10_000_000, 100, 1000).load for _ in range(8)]
    assert choices == [False, False, False, True, False, False, False, True]


def test_a_store_measures_its_reads_and_counts_skipped_loads(tmp_path):
    lay = layout("page")
    store = DiskStore(tmp_path)
    hashes = chain(4)
    store.put(lay, hashes, pages(lay, 4))
    assert store.decide_load(4 * lay.page_bytes, 64, 1e-3).load  # nothing measured yet: load, and measure
    assert len(store.get(lay, hashes)) == 4
    measured = store.stats()["store_read_bytes_per_s"]
    stats = store.stats()
    assert measured == pytest.approx(stats["store_bytes_read"] / stats["store_load_seconds"])
    nbytes = 4 * lay.page_bytes
    tokens_per_s_equal = 64 / (nbytes / measured)  # prefill as fast as the measured read
    assert not store.decide_load(nbytes, 64, tokens_per_s_equal * 10).load  # prefill 10x faster: recompute
    assert store.decide_load(nbytes, 64, tokens_per_s_equal / 10).load
    assert store.stats()["store_recomputed"] == 1
