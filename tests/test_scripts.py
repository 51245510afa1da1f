"""The scripts' shared module and structure (fast), and `compare.sh --quick` end to end (slow)."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_import_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])  # no --out: a parse at import would exit here
    spec.loader.exec_module(module)
    assert [p.__name__ for p in module.PARTS] == ["copy_bandwidth", "decode_kernel", "end_to_end", "split_model"]
    assert not list(tmp_path.iterdir())


def test_common_int_list_and_mib():
    assert common.int_list("256, 1024") == [256, 1024]
    for bad in ("", "0", "-1", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.int_list(bad)
    assert common.mib(3 * 2**19) == "1.5" and common.mib(2**20, 2) == "1.00"


def test_common_dynamic_kv_bytes_counts_keys_and_values():
    from transformers import DynamicCache

    cache = DynamicCache()
    k = torch.zeros(2, 3, 5, 4)
    for layer in range(2):
        cache.update(k, k.clone(), layer)
    assert common.dynamic_kv_bytes(cache) == 2 * 2 * k.numel() * k.element_size()


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout


@pytest.mark.slow
def test_compare_quick_writes_a_new_run_folder_and_changes_nothing_tracked():
    """`compare.sh --quick` (without installing) runs both parts into runs/<time>-quick and leaves git clean."""
    runs = ROOT / "runs"
    before_runs = set(runs.iterdir()) if runs.is_dir() else set()
    before_status = _git_status()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/compare.sh", "--quick", "--no-install", "--threads", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    new = (set(runs.iterdir()) if runs.is_dir() else set()) - before_runs
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert len(new) == 1, new
        out = next(iter(new))
        assert out.name.endswith("-quick")
        for part, stem in (("benchmark", "benchmark"), ("perplexity", "perplexity"), ("many_prompts", "many_prompts")):
            assert {p.name for p in (out / part).iterdir()} >= {f"{stem}.md", f"{stem}.json", f"{stem}.png"}
            assert "Smoke test" in (out / part / f"{stem}.md").read_text()
        assert json.loads((out / "benchmark" / "benchmark.json").read_text())["environment"]["torch_threads"] == 1
        assert json.loads((out / "perplexity" / "perplexity.json").read_text())["settings"]["quick"] is True
        many = json.loads((out / "many_prompts" / "many_prompts.json").read_text())
        assert [r["system"] for r in many["rows"]] == ["dynamic", "paged", "transformers CB", "generate_many", "generate_many packed"]
        assert all(r["equal_prompts"] == many["settings"]["num_prompts"] for r in many["rows"])
        assert "torch threads 1" in proc.stdout and "smoke test" in proc.stdout
        assert _git_status() == before_status  # runs/ is ignored; results/ untouched
    finally:
        for folder in new:
            shutil.rmtree(folder)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script_for_tests", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_perplexity_defaults_are_the_readmes_and_quick_shortens_them():
    ppl = _load("perplexity")
    args = ppl.parse_args([])
    assert (args.max_tokens, args.budgets, args.quick) == (2048, [128, 256, 512, 1024], False)
    quick = ppl.parse_args(["--quick"])
    assert quick.max_tokens < 2048 and max(quick.budgets) < 2048 and quick.quick
    assert ppl.parse_args(["--quick", "--max-tokens", "512"]).max_tokens == 512  # a given flag wins


def _config(dynamic: list[float], paged: list[float]) -> dict:
    """A benchmark configuration entry with these decode speeds per repetition (other fields constant)."""
    runs = lambda speeds: [dict(decode_tok_s=v, prefill_tok_s=100.0) for v in speeds]  # noqa: E731
    med = lambda speeds: sorted(speeds)[len(speeds) // 2]  # noqa: E731
    d, p = dict(runs=runs(dynamic), decode_tok_s=med(dynamic)), dict(runs=runs(paged), decode_tok_s=med(paged))
    return dict(dynamic=d, paged=p, ratios=dict(decode_tok_s=p["decode_tok_s"] / d["decode_tok_s"], prefill_tok_s=1.0))


def test_benchmark_prints_noisy_instead_of_a_ratio_when_repetitions_disagree():
    bench = _load("benchmark")
    steady = _config([10.0, 10.5, 9.8], [12.0, 12.2, 11.9])
    assert bench.spread(steady, "dynamic", "decode_tok_s") == pytest.approx(0.7 / 10.0)
    assert bench.noisy(steady, "decode_tok_s") is None
    assert bench.ratio_text(steady, "decode_tok_s") == f"{12.0 / 10.0:.2f}"
    shaky = _config([10.0, 10.1, 9.9], [12.0, 6.0, 12.1])  # one paged repetition at half speed
    assert bench.noisy(shaky, "decode_tok_s") == pytest.approx(6.1 / 12.0)
    assert bench.ratio_text(shaky, "decode_tok_s") == "noisy (51%)"
    assert bench.spread(_config([10.0], [12.0]), "paged", "decode_tok_s") is None  # one repetition: no spread
