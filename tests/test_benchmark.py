"""scripts/benchmark.py and its study, hf_paged.evaluation.benchmark: configuration sets (fast) and a --quick run on
the real model (slow, no timing asserts)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.evaluation import benchmark as bench
from script_commands import load_script

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "benchmark.py"


parse_args = load_script("benchmark").parse_args  # the command's arguments; the rest is the study's


def test_default_set_covers_every_value():
    configs = bench.build_configs(parse_args([]))
    assert {c.context for c in configs} == {256, 1024, 4096}
    assert {c.batch for c in configs} == {1, 8}
    assert {c.mode for c in configs} == {"greedy", "beam4", "sample8"}
    assert {c.page_size for c in configs} == {16, 128}
    assert len(set(configs)) == len(configs)
    greedy_b1 = {c.context for c in configs if c.mode == "greedy" and c.batch == 1 and c.page_size == 16}
    assert greedy_b1 == {256, 1024, 4096}


def test_axis_flags_and_full_grid():
    args = parse_args(["--contexts", "128,512", "--modes", "greedy,beam2"])
    configs = bench.build_configs(args)
    assert sorted((c.context, c.mode) for c in configs) == [(128, "beam2"), (128, "greedy"), (512, "beam2"),
                                                            (512, "greedy")]
    assert {(c.batch, c.page_size) for c in configs} == {(bench.BASE["batch"], bench.BASE["page_size"])}
    assert len(bench.build_configs(parse_args(["--full"]))) == 3 * 2 * 3 * 2
    quick = parse_args(["--quick"])
    assert quick.repeats == 1 and quick.new_tokens <= 8
    assert {c.mode for c in bench.build_configs(quick)} == {"greedy", "beam4", "sample8"}


def test_modes_and_bad_flags():
    assert bench.parse_mode("beam3")["rows_per_prompt"] == 3
    assert bench.parse_mode("sample2")["kwargs"]["num_return_sequences"] == 2
    assert bench.parse_mode("greedy")["kwargs"]["do_sample"] is False
    for bad in ("beam", "topk5", "sample0"):
        with pytest.raises(ValueError):
            bench.parse_mode(bad)
    for argv in (["--modes", "nucleus"], ["--contexts", "0"], ["--new-tokens", "1"], ["--budget-eviction", "fifo"],
                 ["--budget", "64", "--budget-per-layer", "maybe"]):
        with pytest.raises(SystemExit):
            parse_args(argv)


def test_help_describes_default_set():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True).stdout
    assert "default covering set" in out and "--quick" in out and "beam4" in out


RUN_FIELDS = {"steps", "rows", "total_s", "prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s", "kv_bytes_end",
              "kv_bytes_peak", "pool_bytes_end", "pool_bytes_peak", "peak_mem_growth_bytes", "attn_implementation",
              "cache_class"}
CACHE_FIELDS = {"prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s", "total_s", "decode_ms_per_step",
                "kv_bytes_end", "kv_bytes_peak", "pool_bytes_end", "pool_bytes_peak", "peak_mem_growth_bytes", "runs"}
CONFIG_FIELDS = {"name", "context", "batch", "mode", "page_size", "new_tokens", "rows", "ideal_kv_bytes_end",
                 "dynamic", "paged", "ratios", "tokens_match", "token_agreement", "deterministic_mode", "wall_s"}
STATS_FIELDS = {"page_size", "pages_total", "pages_used", "pages_free", "pages_cached", "tokens_stored", "tokens_held",
                "kv_bytes", "pool_bytes", "evictions", "prefix_hits"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("benchmark")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # One thread: no timing is asserted, and a shared CI machine makes multi-threaded torch crawl.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--threads", "1", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, proc.stdout


@pytest.mark.slow
def test_quick_run_writes_every_output(quick_run):
    out, stdout = quick_run
    assert {p.name for p in out.iterdir()} >= {"benchmark.md", "benchmark.json", "benchmark.png"}
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "benchmark.md").read_text()
    assert "| context | batch | mode |" in table and table.strip() in stdout
    result = json.loads((out / "benchmark.json").read_text())
    env = result["environment"]
    for key in ("torch", "transformers", "hf_paged", "hf_paged_source_sha256", "device", "torch_threads",
                "memory_method"):
        assert env[key] not in (None, "")
    assert env["torch_threads"] == 1
    settings = result["settings"]
    assert settings["quick"] and settings["repeats"] == 1 and settings["model"] == "smollm2"
    assert len(result["configs"]) == len(settings["configs"]) == len(bench.QUICK_SET)
    assert table.count("\n| ") == len(result["configs"]) + 1  # header + one row per configuration
    replot = out / "replot"
    subprocess.run([sys.executable, str(SCRIPT), "--replot", str(out / "benchmark.json"), "--out", str(replot)],
                   capture_output=True, text=True, check=True, cwd=ROOT)
    assert (replot / "benchmark.md").read_text() == table
    assert json.loads((replot / "benchmark.json").read_text()) == result


@pytest.mark.slow
def test_quick_run_json_fields_ratios_and_tokens(quick_run):
    out, _ = quick_run
    result = json.loads((out / "benchmark.json").read_text())
    for cfg in result["configs"]:
        assert CONFIG_FIELDS <= set(cfg), cfg["name"]
        mode = bench.parse_mode(cfg["mode"])
        assert cfg["rows"] == cfg["batch"] * mode["rows_per_prompt"]
        for kind, attn, cls in (("dynamic", "sdpa", "DynamicCache"), ("paged", "hf_paged", "PagedCache")):
            entry = cfg[kind]
            assert CACHE_FIELDS <= set(entry), (cfg["name"], kind)
            assert len(entry["runs"]) == result["settings"]["repeats"]
            for run in entry["runs"]:
                assert RUN_FIELDS <= set(run)
                assert run["attn_implementation"] == attn and run["cache_class"] == cls
                assert run["steps"] == cfg["new_tokens"]  # one processor call per generated token
                assert run["prefill_tok_s"] == pytest.approx(cfg["rows"] * cfg["context"] / run["prefill_s"])
                assert run["decode_tok_s"] == pytest.approx(cfg["rows"] * (run["steps"] - 1) / run["decode_s"])
            for key in ("prefill_tok_s", "decode_tok_s", "kv_bytes_end", "kv_bytes_peak", "peak_mem_growth_bytes"):
                assert math.isfinite(entry[key]) and entry[key] >= 0
            assert entry["prefill_tok_s"] > 0 and entry["decode_tok_s"] > 0
            assert 0 < entry["kv_bytes_end"] <= entry["kv_bytes_peak"] <= entry["pool_bytes_peak"]
        # ratios are paged / dynamic of the reported numbers
        assert set(cfg["ratios"]) == set(bench.RATIO_KEYS)
        for key, ratio in cfg["ratios"].items():
            assert ratio == pytest.approx(cfg["paged"][key] / cfg["dynamic"][key], rel=1e-12), (cfg["name"], key)
        stats = cfg["paged"]["runs"][-1]["stats_end"]
        assert STATS_FIELDS <= set(stats)
        assert stats["page_size"] == cfg["page_size"] and stats["kv_bytes"] == cfg["paged"]["kv_bytes_end"]
        # DynamicCache holds exactly rows x (context + new - 1) tokens (PagedCache may share pages between rows)
        assert cfg["dynamic"]["kv_bytes_end"] == cfg["ideal_kv_bytes_end"]
        if cfg["mode"] == "greedy" or cfg["mode"].startswith("beam"):
            assert cfg["tokens_match"] is True, cfg["name"]
            assert cfg["token_agreement"] == 1.0


def test_alternated_steps_pair_each_unbounded_step_with_the_bounded_one():
    import torch

    tokens = torch.tensor([[5, 6, 7]])
    rounds = [{"paged": dict(step_s=[2.0, 2.0], tokens=tokens), "bounded": dict(step_s=[1.0, 4.0], tokens=tokens)},
              {"paged": dict(step_s=[6.0], tokens=tokens), "bounded": dict(step_s=[4.0], tokens=tokens)}]
    prompt = torch.tensor([[1, 2]])
    same = [torch.cat([prompt, tokens], dim=1)] * 2
    steps = bench.summarize_steps(rounds, same, context=2, kinds=("paged", "bounded"))
    # pairs (unbounded time / bounded) 2.0, 0.5, 1.5: the median 1.5 (the inverse ratios' would be 2/3)
    assert steps["pairs"] == 3 and steps["speed_ratio"] == 1.5
    assert steps["speed_ratio_q1"] < 1.5 < steps["speed_ratio_q3"]
    assert steps["ms_median"] == {"paged": 2000.0, "bounded": 4000.0}
    assert steps["reference_equals_generate"] is True and steps["tokens_equal"] is True
    other = [same[0], torch.cat([prompt, tokens + 1], dim=1)]
    assert bench.summarize_steps(rounds, other, context=2, kinds=("paged", "bounded"))[
        "reference_equals_generate"] is False
    rounds[1]["bounded"] = dict(step_s=[4.0], tokens=tokens + 1)
    assert bench.summarize_steps(rounds, same, context=2, kinds=("paged", "bounded"))["tokens_equal"] is False


@pytest.mark.slow
@pytest.mark.parametrize("options", [[], ["--budget-eviction", "fifo", "--budget-per-layer", "off", "--batch-sizes", "2"],
                                     ["--budget-page-size", "1", "--budget-score-signal", "output",
                                      "--budget-eviction-interval", "4"]])
def test_budget_times_a_bounded_cache_beside_the_unbounded_one(tmp_path, options):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "48", "--batch-sizes", "1", "--modes", "greedy",
                           "--page-sizes", "8", "--new-tokens", "12", "--repeats", "2", "--warmup", "0", "--budget",
                           "32", "--threads", "1", "--no-progress", "--out", str(tmp_path), *options],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "benchmark.json").read_text())
    (cfg,) = result["configs"]
    bounded, paged = cfg["bounded"], cfg["paged"]
    assert CACHE_FIELDS <= set(bounded) and len(bounded["runs"]) == 2
    assert bounded["decode_vs_unbounded"] == pytest.approx(bounded["decode_tok_s"] / paged["decode_tok_s"])
    layers, rows = result["environment"]["num_layers"], cfg["rows"]  # (the last --batch-sizes counts)
    one_group = "--budget-per-layer" in options
    assert rows == (2 if one_group else 1)
    signal = "output" if "--budget-score-signal" in options else "attention"  # (a cut prompt: attention)
    for run in bounded["runs"]:
        assert run["eviction"] == dict(policy="fifo" if one_group else "score", score_signal=signal)
        stats = run["stats_end"]  # each row's 48-token prompt was cut to the budget
        assert stats["tokens_held"] <= 32 * rows and stats["evictions"] > 0
        # evictions count every group's: one group for all layers with the options, one per layer without
        assert (stats["evictions"] < layers) if one_group else (stats["evictions"] % layers == 0)
    assert paged["runs"][-1]["stats_end"]["tokens_held"] == rows * (48 + 11)
    assert 0.0 <= cfg["bounded_agreement"] <= 1.0
    steps = cfg["bounded_steps"]  # one round of 11 alternated decode steps per repeat
    assert steps["pairs"] == 2 * 11 and steps["reference_equals_generate"] is True
    assert 0 < steps["speed_ratio_q1"] <= steps["speed_ratio"] <= steps["speed_ratio_q3"]
    assert steps["ms_median"]["paged"] > 0 and steps["ms_median"]["bounded"] > 0
    policy = ("eviction fifo, per_layer_eviction off" if one_group else "eviction score (the default)"
              + (", score_signal output, eviction_interval 4" if options else ""))
    report = (tmp_path / "benchmark.md").read_text()
    assert f"Bounded PagedCache (at most 32 tokens per row and layer, {policy}," in report
    assert f"| {steps['speed_ratio']:.2f} ({steps['speed_ratio_q1']:.2f}–{steps['speed_ratio_q3']:.2f}) |" in report
    assert "The unbounded cache's tokens in every round equal its `generate` run's: yes." in report
    assert result["settings"]["budget_eviction"] == ("fifo" if one_group else None)
    assert result["settings"]["budget_score_signal"] == ("output" if "--budget-score-signal" in options else None)
    assert result["settings"]["budget_eviction_interval"] == (4 if "--budget-eviction-interval" in options else None)


@pytest.mark.slow
def test_alternate_times_paged_steps_against_dynamic_steps(tmp_path):
    """``--alternate``: rounds in which DynamicCache (sdpa) and PagedCache (hf_paged) take turns, greedy tokens
    equal."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "48", "--batch-sizes", "1", "--modes",
                           "greedy,beam2", "--page-sizes", "8", "--new-tokens", "12", "--repeats", "2", "--warmup", "0",
                           "--alternate", "--threads", "1", "--no-progress", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((tmp_path / "benchmark.json").read_text())
    greedy, beams = result["configs"]
    assert "alternated_steps" not in beams  # greedy configurations only
    steps = greedy["alternated_steps"]
    assert steps["kinds"] == ["dynamic", "paged"] and steps["pairs"] == 2 * 11
    assert steps["reference_equals_generate"] is True and steps["tokens_equal"] is True
    assert 0 < steps["speed_ratio_q1"] <= steps["speed_ratio"] <= steps["speed_ratio_q3"]
    report = (tmp_path / "benchmark.md").read_text()
    assert "decode steps alternated (`--alternate`)" in report
    quartiles = f"{steps['speed_ratio_q1']:.3f}–{steps['speed_ratio_q3']:.3f}"
    assert f"| 48 | 1 | 8 | {steps['speed_ratio']:.3f} ({quartiles}) " in report
    assert "DynamicCache's tokens in every round equal its `generate` run's: yes." in report
