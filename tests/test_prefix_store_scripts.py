"""--prefix-store in the scripts that take a cache (issue 33), on a tiny random Llama saved to a folder.

scripts/benchmark.py and scripts/perplexity.py give every PagedCache they make one store
(`hf_paged.evaluation.caches.StudyStore`) and report its counters; scripts/prefix_store.py's ``torchrun`` part
launches two processes that share a folder store. Each test compares with a run without a store.
"""

from __future__ import annotations

import json

import pytest
import torch
from script_commands import Command, load_script
from test_distributed import tiny_model_dir  # noqa: F401  (the fixture: a random Llama + tokenizer in a folder)

from hf_paged.evaluation import benchmark, perplexity, store_throughput
from hf_paged.evaluation.caches import StudyStore


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_without_a_store_nothing_is_opened_or_counted():
    store = StudyStore(None)
    assert store.store is None and store.cache_kwargs(object()) == {} and store.close("x") is None


def test_benchmark_caches_share_one_store_across_runs_and_restarts(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    bench = Command("benchmark", benchmark)
    argv = ["--model", str(tiny_model_dir), "--contexts", "64", "--batch-sizes", "1", "--modes", "greedy",
            "--page-sizes", "16", "--new-tokens", "3", "--repeats", "2", "--warmup", "0", "--threads", "1",
            "--no-progress", "--prefix-store", str(tmp_path / "store")]
    first = benchmark.main(bench.parse_args([*argv, "--out", str(tmp_path / "a")]), argv)
    totals = first["prefix_store"]
    # run 1 computes the 64-token prompt and writes its 4 full pages; run 2 loads the 3 a forward may skip
    assert totals["uri"] == str(tmp_path / "store") and totals["caches"] == 2
    assert totals["store_pages_written"] == 4 and totals["store_pages_read"] == totals["store_hits"] == 3
    assert totals["store_bytes_read"] > 0 and totals["store_recomputed"] == 0
    assert first["configs"][0]["tokens_match"]  # both runs' tokens equal DynamicCache's
    assert "benchmark PagedCache prefix store" in capsys.readouterr().out
    assert "Prefix store " in (tmp_path / "a" / "benchmark.md").read_text()

    again = benchmark.main(bench.parse_args([*argv, "--out", str(tmp_path / "b")]), argv)  # a restart
    totals = again["prefix_store"]
    assert totals["store_pages_read"] == 6 and totals["store_pages_written"] == 0 and totals["store_misses"] == 0
    assert again["configs"][0]["tokens_match"]
    assert "store_decision" in totals


def test_perplexity_writes_the_store_and_scores_the_same(tiny_model_dir, tmp_path, capsys):  # noqa: F811
    ppl = Command("perplexity", perplexity)
    argv = ["--mode", "strided", "--model", str(tiny_model_dir), "--window", "64", "--stride", "32", "--max-tokens",
            "160", "--page-size", "16", "--threads", "1", "--no-progress"]
    assert ppl.main([*argv, "--out", str(tmp_path / "plain")]) == 0
    assert ppl.main([*argv, "--prefix-store", str(tmp_path / "store"), "--out", str(tmp_path / "stored")]) == 0
    plain, stored = (json.loads((tmp_path / name / "perplexity.json").read_text())["result"]
                     for name in ("plain", "stored"))
    assert [r["nll_sum"] for r in stored["rows"]] == [r["nll_sum"] for r in plain["rows"]]  # exactly: nothing reused
    assert "prefix_store" not in plain
    (totals,) = stored["prefix_store"]
    windows = perplexity.strided_windows(160, 64, 32)
    assert totals["caches"] == len(windows)
    assert totals["store_pages_written"] == sum((end - begin) // 16 for begin, end, _ in windows)
    assert totals["store_pages_read"] == 0  # every token's logits are scored: a forward reuses no page
    assert "perplexity (rank 0) prefix store" in capsys.readouterr().out
    assert "Prefix store of the PagedCaches (rank 0)" in (tmp_path / "stored" / "perplexity.md").read_text()


def test_torchrun_processes_share_a_folder_store_and_reload_it_after_a_restart(tiny_model_dir, tmp_path):  # noqa: F811
    args = load_script("prefix_store").parse_args(
        ["--parts", "torchrun", "--model", str(tiny_model_dir), "--prompts", "4", "--system-tokens", "48",
         "--new-tokens", "3", "--repeats", "1", "--no-progress", "--out", str(tmp_path / "out")])
    store = str(tmp_path / "store")
    runs = {"none": [store_throughput.launch(args, "")], "disk cold": [store_throughput.launch(args, store)],
            "disk warm": [store_throughput.launch(args, store)]}
    none, cold, warm = (rows[0] for rows in runs.values())
    assert none["new_tokens"] == cold["new_tokens"] == warm["new_tokens"] == 4 * 3
    assert none["store_pages_written"] == none["store_hits"] == 0
    assert cold["store_pages_written"] > 0 and warm["store_pages_written"] == 0
    assert warm["store_misses"] == 0 and warm["store_hits"] == warm["store_pages_read"] > 0  # 100% after a restart
    assert none["shared_prefix_tokens"] >= 48
    modes = store_throughput.summarize(runs)
    assert modes["disk warm"]["hit_rate"] == 1.0 and modes["none"]["hit_rate"] is None
    assert all(m["same_completions"] for m in modes.values())  # the store changes no token
    result = dict(model="tiny", prompts=4, system_tokens=48, new_tokens=3, processes=2, rank_threads=1, repeats=1,
                  load_before=[0.0, 0.0, 0.0], load_after=[0.0, 0.0, 0.0], shared_prefix_tokens=48, modes=modes)
    assert "| disk warm |" in store_throughput.markdown_report(result) and "100% (" in \
        store_throughput.markdown_report(result)
    store_throughput.plot(result)(tmp_path / "torchrun.png")
    assert (tmp_path / "torchrun.png").read_bytes()[:4] == b"\x89PNG"


def test_the_measurement_parts_are_chosen_by_name():
    parse = load_script("prefix_store").parse_args
    assert parse([]).parts == ["ttft", "torchrun"] and parse(["--parts", "torchrun"]).parts == ["torchrun"]
    quick = parse(["--quick"])
    assert (quick.prompts, quick.system_tokens, quick.new_tokens, quick.repeats) == (4, 64, 4, 1)
    for bad in (["--parts", "ttft,speed"], ["--prompts", "0"], ["--rank-threads", "0"]):
        with pytest.raises(SystemExit):
            parse(bad)
