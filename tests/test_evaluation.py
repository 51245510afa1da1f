"""scripts/evaluation.py and its study hf_paged.evaluation.long_context: quick mode end to end (every JSON field),
and the core against direct computation."""

import json
import math

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import assets
from hf_paged.evaluation import long_context as study
from script_commands import Command
from tiny_models import make_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def script():
    return Command("evaluation", study)


@pytest.fixture(scope="module")
def report(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("evaluate")
    threads = torch.get_num_threads()
    try:
        assert script.main(["--quick", "--kvpress", "off", "--no-progress", "--threads", "1", "--cpu",
                            "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return out, json.loads((out / "evaluate.json").read_text())


def test_quick_mode_writes_every_output_and_field(report, script):
    out, rep = report
    for name in ("evaluate.md", "evaluate.json", "continuation.png", "passkey.png"):
        assert (out / name).stat().st_size > 0, name
    s = rep["settings"]
    assert set(rep) >= {"settings", "text", "continuation", "passkey", "streaming", "versions", "wall_s"}
    cont = rep["continuation"]
    assert cont["kvpress"]["status"].startswith("not run")
    assert math.isfinite(cont["full_perplexity"]) and cont["full_perplexity"] > 1
    methods = {(r["method"], r["regime"], r["budget"]) for r in cont["rows"]}
    assert methods == {("full", "full", None)} | {(f"hf_paged {p}", g, b) for p in script.DEFAULT_POLICIES
                                                  for g in script.REGIMES for b in s["budgets"]}
    for r in cont["rows"]:
        assert set(r) >= {"library", "method", "regime", "budget", "windows", "tokens", "nll_sum", "perplexity",
                          "excess", "peak_tokens_held", "within_budget", "evictions"}
        assert r["tokens"] == s["windows"] * s["continuation"]
        if r["regime"] == "streaming":  # the streaming regime never holds more than the budget
            assert r["within_budget"] and 0 < r["peak_tokens_held"] <= r["budget"] and r["evictions"] > 0
        if r["regime"] == "compress":  # the prompt whole during prefill, then the budget
            assert r["peak_tokens_held"] == s["context"] and r["tokens_held_after"] <= r["budget"]
        if r["regime"] == "compress+grow":  # the prompt cut to the budget, the continuation on top of it
            assert r["tokens_held_after"] > r["budget"] and not r["within_budget"]
    pk = rep["passkey"]
    assert len(pk["cases"]) == len(s["lengths"]) * len(s["depths"]) * s["trials"]
    assert {(r["method"], r["regime"], r["budget"]) for r in pk["summary"]} == {("full", "full", None)} | {
        (f"hf_paged {p}", g, b) for p in script.DEFAULT_POLICIES for g in script.REGIMES for b in s["passkey_budgets"]}
    for r in pk["rows"]:
        assert set(r) >= {"method", "regime", "budget", "length", "depth", "trials", "accuracy", "answers"}
        assert 0.0 <= r["accuracy"] <= 1.0
    st = rep["streaming"]
    assert {(r["policy"], r["budget"]) for r in st["rows"]} == {("unbounded", None)} | {
        (p, b) for p in script.DEFAULT_POLICIES for b in s["streaming_budgets"]}
    assert all(math.isfinite(r["perplexity"]) and r["perplexity"] > 1 for r in st["rows"])
    assert "Continuation perplexity" in (out / "evaluate.md").read_text()


def test_continuation_full_cache_equals_one_forward(script):
    """The core's full-cache NLL of a continuation is one forward's, and an unbounded PagedCache agrees."""
    model, tokenizer = assets.load_model_and_tokenizer(attn_implementation="hf_paged")
    x = tokenizer("Shakespeare was born at Stratford-on-Avon in 1564 and died there in 1616, "
                  "having written plays and sonnets.", return_tensors="pt").input_ids[0]
    context = len(x) // 2
    with torch.no_grad():
        logits = model(input_ids=x[None], cache=DynamicCache(config=model.config)).logits[0]
    want = -torch.log_softmax(logits[context - 1:-1].double(), -1).gather(-1, x[context:, None])[:, 0]
    got, peak = script.continuation_nll(model, hf_paged.PagedCache(page_size=4, config=model.config), x, context,
                                        "streaming", 4)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert peak == len(x) - 1


def test_passkey_prompts_have_the_length_and_the_key(script):
    _, tokenizer = assets.load_model_and_tokenizer(attn_implementation="sdpa")
    filler = torch.arange(1000, 3000)
    args = script.parse_args(["--lengths", "200,300", "--depths", "0,1", "--trials", "2"])
    cases = script.passkey_cases(args, tokenizer, filler)
    assert [len(c["ids"]) for c in cases] == [200] * 4 + [300] * 4
    for c in cases:
        assert c["key"] in tokenizer.decode(c["ids"])
    assert script.answer_of(" 71432. Remember") == "71432" and script.answer_of(" none") == ""


@pytest.mark.parametrize("bad", [["--tasks", "nope"], ["--budgets", "100", "--page-size", "16"], ["--depths", "1.5"],
                                 ["--policies", "random"], ["--score-decay", "1"], ["--observation-window", "0"],
                                 ["--recent-pages", "-1"], ["--kv-format", "int3"]])
def test_bad_arguments_exit_with_a_message(script, bad, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(bad)
    assert "error" in capsys.readouterr().err


def test_each_page_format_adds_an_unbounded_row_and_its_bounded_rows(script):
    args = script.parse_args(["--kv-format", "float,int4", "--regimes", "compress", "--policies", "score",
                              "--budgets", "128,256", "--windows", "2", "--page-size", "16"])
    jobs = script.continuation_jobs(args)
    methods = {(j["method"], j["budget"], j["kv_format"]) for j in jobs}
    assert methods == {("full", None, "float"), ("full, int4 pages", None, "int4"), ("hf_paged score", 128, "float"),
                       ("hf_paged score", 256, "float"), ("hf_paged score int4", 128, "int4"),
                       ("hf_paged score int4", 256, "int4")}
    assert len(jobs) == 2 * len(methods)
    model, _ = assets.load_model_and_tokenizer(attn_implementation="hf_paged")
    for job in jobs[:2] + [j for j in jobs if j["kv_format"] == "int4"][:2]:
        _, cache = script.job_cache(job, {"paged": model, "dynamic": model}, args)
        assert isinstance(cache, DynamicCache if job["method"] == "full" else hf_paged.PagedCache)
        assert getattr(cache, "kv_format", "float") == job["kv_format"]


def test_tables_and_plots_from_constructed_results(script, tmp_path):
    """Summaries, markdown and plots of hand-made job results, kvpress rows included, without a model."""
    args = script.parse_args(["--budgets", "128,256", "--lengths", "512", "--depths", "0.5", "--trials", "2",
                              "--passkey-budgets", "128"])
    cont = [dict(method="full", regime="full", budget=None, window=0, nll_sum=100.0, tokens=50, peak_tokens_held=0)]
    for method, nll in (("hf_paged fifo+sinks", 110.0), ("kvpress snapkv", 105.0)):
        for b in (128, 256):
            cont.append(dict(method=method, regime="streaming" if "hf" in method else "compress", budget=b, window=0,
                             nll_sum=nll - b / 64, tokens=50, peak_tokens_held=b if "hf" in method else None,
                             evictions=3))
    summary = script.summarize_continuation(cont, dict(status="ok"))
    excess = {(r["method"], r["budget"]): r["excess"] for r in summary["rows"]}
    assert excess[("hf_paged fifo+sinks", 128)] == pytest.approx(math.exp((108.0 - 100.0) / 50) - 1)
    assert excess[("kvpress snapkv", 256)] == pytest.approx(math.exp((101.0 - 100.0) / 50) - 1)
    _, tokenizer = assets.load_model_and_tokenizer(attn_implementation="sdpa")
    cases = [dict(case=i, length=512, depth=0.5, trial=i, key=k, ids=[1]) for i, k in enumerate(("12345", "67890"))]
    answer = tokenizer(" 12345.", add_special_tokens=False).input_ids
    pk = [dict(method=m, regime=g, budget=b, case=c, tokens=answer) for m, g, b in
          (("full", "full", None), ("hf_paged score", "compress", 128), ("kvpress snapkv", "compress", 128))
          for c in (0, 1)]
    passkey = script.summarize_passkey(pk, cases, tokenizer, dict(status="ok"))
    assert {r["method"]: r["accuracy"] for r in passkey["summary"]} == {
        "full": 0.5, "hf_paged score": 0.5, "kvpress snapkv": 0.5}  # the answer is the first key only
    report = dict(settings=vars(args), text=dict(source="constructed"), continuation=summary, passkey=passkey,
                  streaming=dict(tokens=10, rows=[dict(policy="unbounded", budget=None, perplexity=2.0, excess=0.0)]))
    text = script.markdown(report)
    assert "| kvpress snapkv | compress | +6.2%* | +2.0%* |" in text and "| hf_paged fifo+sinks | streaming |" in text
    assert script.plot(report, tmp_path) == ["continuation.png", "passkey.png"]


def test_score_signal_reaches_the_score_caches_only(script):
    """``--score-signal`` sets the score policy's signal in both regimes and leaves lru on attention; without it
    the cache's defaults hold (page size 1: the output signal streaming, attention for a compressed prompt)."""
    _, model = make_pair("llama")

    def signal(argv, policy, regime):
        return script.bounded_cache(model, script.parse_args(argv), policy, regime, 64).policy.signal

    forced = ["--score-signal", "attention"]
    assert signal(forced, "score", "streaming") == signal(forced, "score", "compress") == "attention"
    assert signal(["--score-signal", "output"], "score", "compress") == "output"
    assert signal(["--score-signal", "output"], "lru", "streaming") == "attention"
    assert (signal([], "score", "streaming"), signal([], "score", "compress")) == ("output", "attention")


def test_eviction_interval_reaches_the_bounded_caches_and_names_their_rows(script):
    """``--eviction-interval k`` builds the bounded caches with ``eviction_interval=k`` and names their rows
    'hf_paged <policy>, interval k' (so that runs with and without it pair in `scripts/paired_rows.py`); without it
    the caches take `PagedCache`'s default and their rows keep their plain names."""
    _, model = make_pair("llama")
    args = script.parse_args(["--eviction-interval", "1", "--tasks", "continuation", "--windows", "1"])
    assert script.bounded_cache(model, args, "score", "compress", 64).policy.interval == 1
    methods = {job["method"] for job in script.continuation_jobs(args) if job["regime"] != "full"}
    assert methods == {f"hf_paged {policy}, interval 1" for policy in args.policies}
    plain = script.parse_args(["--tasks", "continuation", "--windows", "1"])
    default = hf_paged.PagedCache(page_size=1, max_pages=64, compress_prompt=True).policy.interval
    assert script.bounded_cache(model, plain, "score", "compress", 64).policy.interval == default > 1
    methods = {job["method"] for job in script.continuation_jobs(plain) if job["regime"] != "full"}
    assert methods == {f"hf_paged {policy}" for policy in plain.policies}
