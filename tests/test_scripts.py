"""The scripts' shared package `hf_paged.evaluation` and their structure (fast); `compare.sh --quick` (slow)."""

import argparse
import ast
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged.evaluation import benchmark, caches, formats, run_info
from hf_paged.evaluation.nll import CacheStream, token_nll
from script_commands import load_script
from tiny_models import make_pair

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def test_gpu_check_import_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = importlib.util.spec_from_file_location("gpu_check_script", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])  # no --out: a parse at import would exit here
    spec.loader.exec_module(module)
    assert [p.__name__ for p in module.PARTS] == ["copy_bandwidth", "decode_kernel", "end_to_end", "split_model",
                                                  "sampled_generate_many"]
    assert not list(tmp_path.iterdir())


def test_formats_lists_mib_and_json(tmp_path):
    assert formats.int_list("256, 1024") == [256, 1024]
    for bad in ("", "0", "-1", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            formats.int_list(bad)
    assert formats.value_list(float)("0.1, 0.5") == [0.1, 0.5]
    with pytest.raises(argparse.ArgumentTypeError):
        formats.value_list(int)("1,x")
    assert formats.mib(3 * 2**19) == "1.5" and formats.mib(2**20, 2) == "1.00"
    data = {"a": [1.5, float("nan")], "b": float("inf")}
    formats.write_json(tmp_path / "strict.json", data)
    assert json.loads((tmp_path / "strict.json").read_text()) == {"a": [1.5, None], "b": None}
    formats.write_json(tmp_path / "loose.json", data, indent=None, strict=False, newline=False)
    assert (tmp_path / "loose.json").read_text() == '{"a": [1.5, NaN], "b": Infinity}'


def test_caches_count_keys_values_tokens_and_rows():
    """kv_bytes, tokens_held and cache_rows agree between a DynamicCache and a PagedCache after beam search."""
    ref, paged = make_pair("llama")
    cache = DynamicCache()
    k = torch.zeros(2, 3, 5, 4)
    for layer in range(2):
        cache.update(k, k.clone(), layer)
    assert caches.dynamic_kv_bytes(cache) == 2 * 2 * k.numel() * k.element_size()
    assert caches.kv_bytes(cache) == (caches.dynamic_kv_bytes(cache),) * 2
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(0))
    rows, held = {}, {}
    for kind, model in (("dynamic", ref), ("paged", paged)):
        made = caches.make_cache(kind, model, page_size=4)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=3, max_new_tokens=4,
                       min_new_tokens=4, pad_token_id=0, **{hf_paged.CACHE_KWARG: made})
        rows[kind], held[kind] = caches.cache_rows(made), caches.tokens_held(made)
    assert rows == {"dynamic": 3, "paged": 3}
    assert held == {"dynamic": 13, "paged": 3 * 13}  # a DynamicCache's first layer per row; the paged rows summed


def test_cache_stream_scores_like_one_forward():
    """NLL streamed in chunks at explicit positions through a PagedCache equals one forward's over a DynamicCache;
    score_after continues a fed prefix; greedy feeds back the argmax."""
    ref, paged = make_pair("llama")
    ids = torch.randint(3, 90, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = ref(input_ids=ids, **{hf_paged.CACHE_KWARG: DynamicCache(config=ref.config)}).logits
    want = token_nll(logits[:, :-1], ids[:, 1:])
    stream = CacheStream(paged, hf_paged.PagedCache(page_size=4, config=paged.config), hf_paged.CACHE_KWARG)
    got = stream.score(ids, chunk=6)
    assert got.shape == (2, 20) and got.dtype == torch.float64 and stream.position == 20
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    seen = []
    stream = CacheStream(paged, hf_paged.PagedCache(page_size=4, config=paged.config), hf_paged.CACHE_KWARG,
                         after_forward=lambda: seen.append(stream.position))
    last = stream.feed(ids[:1, :8], chunk=3)[0]
    torch.testing.assert_close(stream.score_after(last, ids[0, 8:], chunk=5), want[0, 7:], atol=1e-5, rtol=1e-5)
    assert seen == [3, 6, 8, 13, 18, 20]  # after every forward: prefix chunks 3, 3, 2, then 12 tokens in 5, 5, 2
    direct = float(-torch.log_softmax(logits[0, -1], -1)[ids[0, 0]])
    assert math.isclose(float(token_nll(logits[0, -1], ids[0, 0])), direct, rel_tol=1e-6)
    stream = CacheStream(paged, hf_paged.PagedCache(page_size=4, config=paged.config), hf_paged.CACHE_KWARG)
    tokens = stream.greedy(stream.feed(ids[:1, :5])[0], 4)
    sequence = ids[0, :5].tolist()
    with torch.no_grad():  # greedy without a cache: the whole sequence again for every token
        for _ in range(4):
            sequence.append(int(ref(input_ids=torch.tensor([sequence]), use_cache=False).logits[0, -1].argmax()))
    assert tokens == sequence[5:] and stream.position == 9  # the last token is fed back too


def test_run_info_versions_and_load():
    info = run_info.versions(("torch", "no-such-package-here"))
    assert list(info) == ["python", "platform", "torch", "no-such-package-here"]
    assert info["torch"] == torch.__version__ and info["no-such-package-here"] is None
    load = run_info.load_average()
    assert load is None or len(load) == 3
    assert len(run_info.source_fingerprint(hf_paged)) == 12


SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))


def test_no_script_imports_another_script():
    """Scripts are commands over hf_paged.evaluation: none imports a sibling (no import cycles between them)."""
    names = {path.stem for path in SCRIPTS}
    for path in SCRIPTS:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert not imported & names, f"{path.name} imports {imported & names}"


def test_kvpress_runner_needs_nothing_of_the_hf_paged_package():
    """kvpress's environment has an older transformers: the runner loads nll.py and run_info.py by path, and those
    files import neither hf_paged nor transformers."""
    code = ("import sys; sys.modules['hf_paged'] = None; sys.modules['transformers'] = None; import runpy; "
            f"runner = runpy.run_path({str(ROOT / 'scripts' / 'kvpress_runner.py')!r}); "
            "print(runner['nll'].CacheStream.__name__, sorted(runner['load']('run_info').versions(('torch',))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["CacheStream", "['platform',", "'python',", "'torch']"]


def _git_status() -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], capture_output=True, text=True,
                          check=True, cwd=ROOT).stdout


@pytest.mark.slow
def test_compare_quick_writes_a_new_run_folder_and_changes_nothing_tracked():
    """`compare.sh --quick` (without installing) runs every part into runs/<time>-quick and leaves git clean."""
    runs = ROOT / "runs"
    before_runs = set(runs.iterdir()) if runs.is_dir() else set()
    before_status = _git_status()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/compare.sh", "--quick", "--no-install", "--threads", "1"], cwd=ROOT,
                          env=env,
                          capture_output=True, text=True, timeout=1800)
    new = (set(runs.iterdir()) if runs.is_dir() else set()) - before_runs
    try:
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert len(new) == 1, new
        out = next(iter(new))
        assert out.name.endswith("-quick")
        for part, stem in (("benchmark", "benchmark"), ("perplexity", "perplexity"), ("many_prompts", "many_prompts"),
                           ("quantized", "quantized")):
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


def test_perplexity_defaults_are_the_stored_studys_and_quick_shortens_them():
    ppl = load_script("perplexity")
    args = ppl.parse_args([])
    assert (args.max_tokens, args.budgets, args.quick) == (2048, [128, 256, 512, 1024], False)
    quick = ppl.parse_args(["--quick"])
    assert quick.max_tokens < 2048 and max(quick.budgets) < 2048 and quick.quick
    assert ppl.parse_args(["--quick", "--max-tokens", "512"]).max_tokens == 512  # a given flag wins


def test_many_prompts_systems_default_to_all_and_unknown_names_are_refused(capsys):
    many = load_script("many_prompts")
    assert many.parse_args([]).systems == list(many.study.SYSTEMS) and not many.parse_args([]).compile
    assert many.parse_args(["--systems", "generate_many packed, dynamic"]).systems == ["generate_many packed",
                                                                                        "dynamic"]
    with pytest.raises(SystemExit):
        many.parse_args(["--systems", "dynamic,vllm"])
    assert "unknown ['vllm']" in capsys.readouterr().err


def test_many_prompts_compiled_row_per_step_budget():
    """--compile-batch-tokens makes one compiled row per step budget; without it the one row keeps its name."""
    many = load_script("many_prompts")
    args = many.parse_args(["--compile"])
    assert args.compile_batch_tokens is None
    assert many.study.compiled_systems(args) == {"generate_many compiled": 256}
    args = many.parse_args(["--compile", "--max-batch-tokens", "512", "--compile-batch-tokens", "512"])
    assert many.study.compiled_systems(args) == {"generate_many compiled": 512}
    args = many.parse_args(["--compile", "--compile-batch-tokens", "256, 4096"])
    assert many.study.compiled_systems(args) == {"generate_many compiled (256)": 256,
                                                 "generate_many compiled (4096)": 4096}


def _config(dynamic: list[float], paged: list[float]) -> dict:
    """A benchmark configuration entry with these decode speeds per repetition (other fields constant)."""
    runs = lambda speeds: [dict(decode_tok_s=v, prefill_tok_s=100.0) for v in speeds]  # noqa: E731
    med = lambda speeds: sorted(speeds)[len(speeds) // 2]  # noqa: E731
    d, p = dict(runs=runs(dynamic), decode_tok_s=med(dynamic)), dict(runs=runs(paged), decode_tok_s=med(paged))
    return dict(dynamic=d, paged=p, ratios=dict(decode_tok_s=p["decode_tok_s"] / d["decode_tok_s"], prefill_tok_s=1.0))


def test_benchmark_marks_a_ratio_noisy_when_repetitions_disagree():
    bench = benchmark
    steady = _config([10.0, 10.5, 9.8], [12.0, 12.2, 11.9])
    assert bench.spread(steady, "dynamic", "decode_tok_s") == pytest.approx(0.7 / 10.0)
    assert bench.noisy(steady, "decode_tok_s") is None
    assert bench.ratio_text(steady, "decode_tok_s") == f"{12.0 / 10.0:.2f}"
    shaky = _config([10.0, 10.1, 9.9], [12.0, 6.0, 12.1])  # one paged repetition at half speed
    assert bench.noisy(shaky, "decode_tok_s") == pytest.approx(6.1 / 12.0)
    assert bench.ratio_text(shaky, "decode_tok_s") == f"{(12.0 / 10.0):.2f} (noisy, 51%)"
    assert bench.spread(_config([10.0], [12.0]), "paged", "decode_tok_s") is None  # one repetition: no spread
