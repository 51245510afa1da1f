"""scripts/quantized.py (`hf_paged.evaluation.quantized`): its schemes are the page formats' (bytes and round
trips), KIVI's simulation, the speed part end to end on small shapes (fast), and the perplexity part on the real
SmolLM2 (slow)."""

import json
import types

import pytest
import torch
from script_commands import Command

from hf_paged.evaluation import quantized as study
from hf_paged.kv_formats import QuantizedPages, page_format

quantized = Command("quantized", study)

pytestmark = pytest.mark.usefixtures("one_thread")  # (main sets torch's threads: the fixture puts them back)


def test_format_schemes_hand_back_what_the_pages_store_and_count_their_bytes():
    """The simulation of "int8" and "int4" is the pages' own write-then-gather, and their bytes per token are
    the pages' bytes (scales included); float32 and bfloat16 count 4 and 2 bytes an element. Pages of 16 (int4's
    keys keep their parameters per page: its bytes depend on the page size)."""
    S, H, D = 16, 3, 64
    schemes = {s.name: s for s in quantized.schemes(D, S)}
    assert schemes["float32"].bytes_per_head == 2 * 4 * D and schemes["bfloat16"].bytes_per_head == 2 * 2 * D
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, H, 3 * S, D, generator=g) * 4, torch.randn(2, H, 3 * S, D, generator=g)
    for name in ("int8", "int4"):
        pages = QuantizedPages(page_format(name), S, H, D, D, torch.float32, "cpu")
        pages.grow_to(6)
        slots = torch.arange(6 * S)
        pages.write(slots, keys.transpose(1, 2).flatten(0, 1), values.transpose(1, 2).flatten(0, 1))
        stored_keys, stored_values = (t.flatten(0, 1).unflatten(0, (2, 3 * S)).transpose(1, 2)
                                      for t in pages.gather(torch.arange(6)))
        assert torch.equal(schemes[name].keys(keys), stored_keys)
        assert torch.equal(schemes[name].values(values), stored_values)
        assert schemes[name].bytes_per_head == pages.page_bytes() / (S * H)
    assert schemes["int8"].bytes_per_head / schemes["float32"].bytes_per_head <= 0.27
    assert schemes["int4"].bytes_per_head / schemes["float32"].bytes_per_head <= 0.16


def test_first_page_schemes_keep_the_attention_sinks_and_count_their_bytes():
    """int4 with the first page kept in float32: through `SimulatedPages`, fed in two updates that split the first
    page, the first page's keys and values read back exact and every later token as int4's; its bytes are int4's
    plus the first page's extra float32 bytes spread over the text's tokens."""
    S, H, D, T = 4, 2, 8, 13
    schemes = {s.name: s for s in quantized.schemes(D, S, tokens=T)}
    sinks, int4 = schemes["int4, first page float32 (attention sinks)"], schemes["int4"]
    assert sinks.bytes_per_head == pytest.approx(int4.bytes_per_head + S * (8 * D - int4.bytes_per_head) / T)
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(1, H, T, D, generator=g), torch.randn(1, H, T, D, generator=g)
    got, want = study.SimulatedPages(sinks), study.SimulatedPages(int4)
    for cache in (got, want):
        cache.update(keys[:, :, :2], values[:, :, :2], 0)
        read_keys, read_values = cache.update(keys[:, :, 2:], values[:, :, 2:], 0)
        if cache is got:
            assert torch.equal(read_keys[:, :, :S], keys[:, :, :S]) and torch.equal(read_values[:, :, :S],
                                                                                    values[:, :, :S])
            sink_read = read_keys[:, :, S:], read_values[:, :, S:]
    assert torch.equal(sink_read[0], read_keys[:, :, S:]) and torch.equal(sink_read[1], read_values[:, :, S:])
    assert not torch.equal(read_keys[:, :, :S], keys[:, :, :S])  # int4 alone changes the first page


def test_kivi_keys_quantize_full_pages_per_channel_and_leave_the_last_partial_page():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 37, 8, generator=g) * torch.linspace(0.1, 10, 8)  # channels of very different ranges
    back = quantized.kivi_keys(16)(x)
    assert torch.equal(back[..., 32:, :], x[..., 32:, :])
    pages = x[..., :32, :].unflatten(-2, (2, 16))
    step = (pages.amax(-2, keepdim=True) - pages.amin(-2, keepdim=True)) / 15
    error = (back[..., :32, :].unflatten(-2, (2, 16)) - pages).abs()
    assert (error <= step * 0.51 + 1e-3).all() and error.max() > 0


def test_speed_part_writes_its_table_json_and_plot(tmp_path):
    assert quantized.main(["--parts", "speed", "--contexts", "40", "--batches", "1,2", "--repeats", "2", "--calls",
                           "1", "--out", str(tmp_path), "--no-progress"]) == 0
    report = json.loads((tmp_path / "quantized.json").read_text())
    results = report["speed"]["results"]
    assert {(r["batch"], r["format"]) for r in results} == {(b, f) for b in (1, 2) for f in quantized.SPEED_FORMATS}
    assert all(r["cpu_ratio"] == 1 for r in results if r["format"] == "float32")
    assert all(r["cpu_ms"] > 0 and r["kv_bytes"] > 0 for r in results)
    kv_bytes = {r["format"]: r["kv_bytes"] for r in results if r["batch"] == 1}
    assert kv_bytes["int4"] < kv_bytes["float32+int4"] < kv_bytes["float32"]  # some pages float32, most int4
    assert report["environment"]["load_avg_start"] is not None and "perplexity" not in report
    assert "| 40 | 2 | int4 |" in (tmp_path / "quantized.md").read_text()
    assert (tmp_path / "quantized.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_parts_are_refused():
    with pytest.raises(SystemExit):
        quantized.parse_args(["--parts", "speed,memory"])


@pytest.mark.slow
def test_perplexity_part_on_the_real_model(tmp_path):
    """float32 is its own reference (0, no KL); int8 is within 0.2% at a fraction of a nat of KL; every row has
    an interval around its ratio."""
    assert quantized.main(["--quick", "--parts", "perplexity", "--max-tokens", "128", "--out", str(tmp_path),
                           "--no-progress"]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "quantized.json").read_text())["perplexity"]["rows"]}
    assert rows["float32"]["relative"] == rows["float32"]["kl_mean"] == 0 and rows["float32"]["bytes_ratio"] == 1
    assert abs(rows["int8"]["relative"]) < 0.002 and rows["int8"]["kl_mean"] < 0.005
    assert rows["int4"]["kl_mean"] > rows["int8"]["kl_mean"]
    assert all(r["low"] <= r["relative"] <= r["high"] for r in rows.values())
    assert len(rows) == len(quantized.schemes(64, 16))


@pytest.mark.slow
def test_cache_part_measures_the_real_caches(tmp_path):
    """Through PagedCache/generate_many pages: bytes per token from stats() (int8 about a quarter of float32's),
    float32 pages as their own reference at each length (int2 the smallest), bfloat16 and the QuantizedCache rows
    beside the formats
    (or skipped with a reason), int4 cold pages last (paired with QuantizedCache int4 where it ran)."""
    assert quantized.main(["--quick", "--parts", "cache", "--cache-tokens", "64,96", "--out", str(tmp_path),
                           "--no-progress"]) == 0
    cache = json.loads((tmp_path / "quantized.json").read_text())["cache"]
    sizes = cache["bytes_per_token"]
    assert sizes["bfloat16"] == sizes["float32"] / 2 and 0.25 < sizes["int8"] / sizes["float32"] <= 0.27
    assert sizes["int2"] < sizes["int4"] < sizes["int8"]
    assert sizes["int4"] < sizes[quantized.COLD] < sizes["int4"] + sizes["float32"] / 2  # (2 pages: the sink float)
    peers = [] if cache["peer_skipped"] else [f"QuantizedCache int{n} (quanto)" for n in (4, 2)]
    assert [block["tokens"] for block in cache["perplexity"]] == [64, 96]
    for block in cache["perplexity"]:
        rows = block["rows"]
        assert [row["name"] for row in rows] == ["float32", "bfloat16", "int8", "int4", "int2", *peers, quantized.COLD]
        assert ("vs_peer" in rows[-1]) == bool(peers) and rows[-1]["kl_mean"] < rows[3]["kl_mean"]
        assert rows[0]["relative"] == rows[0]["kl_mean"] == 0 and rows[0]["tokens"] == block["tokens"]
        assert all(r["low"] <= r["relative"] <= r["high"] and r["bytes_per_token"] > 0 for r in rows)
    for name in peers:
        assert sizes[name] < cache["peer_bytes"][name]["full_residual"]
    assert "## Through the real caches" in (tmp_path / "quantized.md").read_text()


@pytest.mark.slow
def test_agreement_part_counts_tokens_before_the_first_difference_per_prompt(tmp_path):
    """generate_many with each entry over the many-prompts workload: float pages agree with themselves, every entry
    has a count per prompt and its run's peak bytes (the quantized and cold ones below float32's)."""
    assert quantized.main(["--quick", "--parts", "agreement", "--num-prompts", "3", "--repeats", "1",
                           "--out", str(tmp_path), "--no-progress"]) == 0
    rows = {r["cache"]: r for r in json.loads((tmp_path / "quantized.json").read_text())["agreement"]["rows"]}
    assert list(rows) == list(quantized.AGREEMENT_ENTRIES)
    assert rows["float"]["equal"] == 3 and rows["float"]["min"] == min(rows["float"]["wanted"])
    assert all(len(r["tokens_before_divergence"]) == 3 and r["cpu_s"] > 0 for r in rows.values())
    assert all(rows[name]["peak_kv_bytes"] < rows["float"]["peak_kv_bytes"] for name in list(rows)[1:])
    assert "## Greedy agreement with float pages" in (tmp_path / "quantized.md").read_text()


@pytest.mark.slow
def test_mixed_part_times_the_mixed_cache_against_float_pages_and_the_bounded_cache(tmp_path):
    """The mixed cache (read by the kernel, and by the torch path) holds every token in the bounded cache's bytes,
    most of them cold; float32 pages are the reference of each round."""
    assert quantized.main(["--quick", "--parts", "mixed", "--decode-contexts", "96", "--decode-batches", "1",
                           "--decode-tokens", "2", "--repeats", "2", "--out", str(tmp_path), "--no-progress"]) == 0
    rows = {r["cache"]: r for r in json.loads((tmp_path / "quantized.json").read_text())["mixed"]["results"]}
    assert list(rows) == list(quantized.MIXED_ENTRIES) and rows["float"]["cpu_ratio"] == 1
    assert rows["bounded float"]["tokens_held"] == rows["bounded float"]["budget"] == 24
    for name in ("mixed int4", "mixed int4, torch path"):
        assert rows[name]["tokens_held"] == 95 and rows[name]["pages_cold"] > 0
        assert rows[name]["kv_bytes"] <= rows["bounded float"]["kv_bytes"]
    assert "## Mixed precision" in (tmp_path / "quantized.md").read_text()


@pytest.mark.slow
def test_decode_part_times_every_cache_against_float_pages(tmp_path):
    assert quantized.main(["--quick", "--parts", "decode", "--decode-contexts", "48", "--decode-batches", "1,2",
                           "--decode-tokens", "2", "--repeats", "1", "--peer-bits", "4", "--out", str(tmp_path),
                           "--no-progress"]) == 0
    decode = json.loads((tmp_path / "quantized.json").read_text())["decode"]
    peers = [] if decode["peer_skipped"] else ["QuantizedCache int4 (quanto)"]
    names = [*quantized.CACHE_FORMATS, quantized.COLD, *peers]
    assert [(r["batch"], r["cache"]) for r in decode["results"]] == [(b, n) for b in (1, 2) for n in names]
    assert all(r["cpu_ratio"] == 1 for r in decode["results"] if r["cache"] == "float")
    one, two = ({r["cache"]: r["kv_bytes"] for r in decode["results"] if r["batch"] == b} for b in (1, 2))
    assert all(two[name] > one[name] for name in names)  # the rows of a batch hold pages of their own
    assert "| 48 | 2 | int4 |" in (tmp_path / "quantized.md").read_text()
    assert all(r["peak_rss"] > 0 for r in decode["results"])


def test_release_memory_trims_the_heap(monkeypatch):
    """The decode part's process grew past what its caches held (a 4k-token batch-8 run to 7.9 GB): once glibc
    has freed a large block it serves blocks of that size from its heap, whose freed holes stay resident.
    `release_memory` (between timed runs) collects and hands them back with ``malloc_trim(0)``; without glibc it
    only collects."""
    calls = []
    monkeypatch.setattr(study, "_libc", lambda: types.SimpleNamespace(malloc_trim=calls.append))
    study.release_memory()
    assert calls == [0]
    monkeypatch.setattr(study, "_libc", lambda: False)
    study.release_memory()
