"""scripts/perplexity.py (both modes, its study hf_paged.evaluation.perplexity) and the evaluate metric in
integrations/perplexity_metric, on the real SmolLM2."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from hf_paged import assets
from hf_paged.evaluation import perplexity as study
from script_commands import Command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
METRIC = ROOT / "integrations" / "perplexity_metric"
TOL = 1e-4
TEXTS = [
    "William Shakespeare was born at Stratford-on-Avon in April 1564, the son of John Shakespeare.",
    "The first folio of the plays was printed in 1623, seven years after his death.",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread here (the script runs get ``--threads 1``): forwards this small gain little from
    two threads and lose a lot on a busy machine. Put torch's thread count back for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.fixture(scope="module")
def script():
    return Command("perplexity", study)


@pytest.fixture(scope="module")
def reference():
    """The baseline: real SmolLM2 with "sdpa" attention (what DynamicCache runs with in the script)."""
    return assets.load_model_and_tokenizer(attn_implementation="sdpa")


@torch.no_grad()
def direct_nll(model, ids: torch.Tensor, labels: torch.Tensor | None = None) -> tuple[float, int]:
    """NLL sum and count of one forward over ``ids`` with a fresh DynamicCache (labels -100 = not scored)."""
    labels = ids.clone() if labels is None else labels
    logits = model(input_ids=ids[None], cache=DynamicCache(config=model.config), use_cache=True).logits[0]
    targets = labels[1:]
    keep = targets != -100
    nll = torch.nn.functional.cross_entropy(logits[:-1][keep].double(), targets[keep], reduction="sum")
    return float(nll), int(keep.sum())


def check_common(report: dict, out: Path, mode: str) -> None:
    assert set(report) >= {"settings", "text", "result", "versions", "wall_s"}
    assert report["settings"]["mode"] == mode and report["settings"]["num_processes"] == 1
    assert {"torch", "transformers", "datasets", "accelerate", "hf_paged"} <= set(report["versions"])
    assert report["text"]["source"].startswith("britannica")
    png = out / "perplexity.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    assert (out / "perplexity.md").read_text().startswith("# Perplexity")


def test_strided_paged_matches_dynamic(script, reference, tmp_path):
    rc = script.main(["--mode", "strided", "--window", "128", "--stride", "64", "--max-tokens", "400",
                      "--page-size", "16", "--threads", "1", "--out", str(tmp_path), "--no-progress"])
    report = json.loads((tmp_path / "perplexity.json").read_text())
    check_common(report, tmp_path, "strided")
    assert rc == 0
    result = report["result"]
    assert report["text"]["tokens"] == 400
    windows = script.strided_windows(400, 128, 64)
    assert [(w["begin"], w["end"], w["target_len"]) for w in result["windows"]] == windows
    dynamic, paged = result["rows"]
    assert (dynamic["cache"], paged["cache"]) == ("DynamicCache", "PagedCache(page_size=16)")
    assert dynamic["tokens"] == paged["tokens"] == 399  # every token but the first, exactly once
    assert rel(paged["perplexity"], dynamic["perplexity"]) <= TOL
    assert result["parity"]["ok"] and result["parity"]["relative_diff"] <= TOL

    # the guide's numbers, recomputed here: the same windows, labels -100 on the overlap
    model, tok = reference
    ids = tok("\n\n".join(assets.britannica_dataset()["text"][:8]), return_tensors="pt").input_ids[0][:400]
    nll, count = 0.0, 0
    for begin, end, target_len in windows:
        labels = ids[begin:end].clone()
        labels[:-target_len] = -100
        n, c = direct_nll(model, ids[begin:end], labels)
        nll, count = nll + n, count + c
    assert count == 399
    assert rel(dynamic["perplexity"], math.exp(nll / count)) <= TOL


@pytest.fixture(scope="module")
def streaming(script, tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming")
    rc = script.main(["--mode", "streaming", "--max-tokens", "256", "--budgets", "64,128", "--page-size", "16",
                      "--threads", "1", "--out", str(out), "--no-progress"])
    return rc, out, json.loads((out / "perplexity.json").read_text())


def test_streaming_unbounded_matches_full(streaming, reference):
    rc, out, report = streaming
    check_common(report, out, "streaming")
    rows = {row["name"]: row for row in report["result"]["rows"]}
    full, unbounded = rows["full"], rows["unbounded"]
    assert full["status"] == unbounded["status"] == "ok"
    assert full["tokens"] == unbounded["tokens"] == 255
    assert full["tokens_held"] == unbounded["tokens_held"] == 255
    assert unbounded["stats"]["evictions"] == 0
    assert rel(unbounded["perplexity"], full["perplexity"]) <= TOL
    assert report["result"]["parity"]["ok"]
    # 16 chunks through one cache == one forward over the 256 tokens (positions continue correctly)
    model, tok = reference
    ids = tok("\n\n".join(assets.britannica_dataset()["text"][:8]), return_tensors="pt").input_ids[0][:256]
    nll, count = direct_nll(model, ids)
    assert rel(full["perplexity"], math.exp(nll / count)) <= TOL
    assert set(rows) == {"full", "unbounded"} | {f"{p}@{b}" for p in ("score", "lru", "fifo+sinks", "fifo")
                                                      for b in (64, 128)}


def test_streaming_eviction_policies(streaming):
    rc, out, report = streaming
    rows = [row for row in report["result"]["rows"] if row["budget"] is not None]
    assert len(rows) == 8
    errors = {row["name"]: row.get("error") for row in rows if row["status"] != "ok"}
    assert not errors, errors
    assert rc == 0
    full = report["result"]["rows"][0]["perplexity"]
    for row in rows:
        assert row["max_pages"] == row["budget"] // 16
        assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1
        assert row["tokens_held"] <= row["budget"]
        assert row["stats"]["evictions"] > 0  # 255 tokens never fit in 64 or 128
        assert row["relative_to_full"] == pytest.approx(row["perplexity"] / full - 1)
    assert {row["policy_kwargs"]["sink_pages"] for row in rows if row["policy"] == "fifo"} == {0}
    assert {row["policy_kwargs"]["sink_pages"] for row in rows if row["policy"] == "fifo+sinks"} == {1}


def test_streaming_compares_with_fifo_sinks_and_replots(script, streaming, tmp_path):
    rc, out, report = streaming
    comparison = report["result"]["segment_comparison"]
    rows = [row for row in report["result"]["rows"] if row["budget"] is not None]
    assert {(c["policy"], c["budget"]) for c in comparison} == {(row["policy"], row["budget"]) for row in rows}
    for c in comparison:
        assert c["reference"] == ("full" if c["policy"] == "fifo+sinks" else "fifo+sinks")
        assert c["lower"] + c["higher"] + c["equal"] == c["segments"] == 1  # 255 tokens, segments of 512
    md = (out / "perplexity.md").read_text()
    assert md.count("| budget | score vs fifo+sinks | lru vs fifo+sinks | fifo+sinks vs full | fifo vs fifo+sinks |") == 2
    intervals = report["result"]["paired_intervals"]
    assert [(c["policy"], c["budget"], c["reference"]) for c in intervals] == [
        (c["policy"], c["budget"], c["reference"]) for c in comparison]
    by_name = {row["name"]: row for row in report["result"]["rows"]}
    for c in intervals:
        assert c["blocks"] == 4 and c["block"] == 64 and c["confidence"] == 0.95  # 255 tokens in blocks of 64
        row, ref = by_name[f"{c['policy']}@{c['budget']}"], by_name["full" if c["reference"] == "full" else f"fifo+sinks@{c['budget']}"]
        assert math.fsum(row["block_nll"]) == pytest.approx(row["nll_sum"], rel=1e-12)
        assert c["ratio"] == pytest.approx(row["perplexity"] / ref["perplexity"] - 1, rel=1e-9, abs=1e-12)
        assert c["low"] <= c["ratio"] <= c["high"]
    # --replot recomputes the comparison from the rows and writes the same files
    stored = json.loads((out / "perplexity.json").read_text())
    del stored["result"]["segment_comparison"], stored["result"]["paired_intervals"]
    (tmp_path / "old.json").write_text(json.dumps(stored))
    assert script.main(["--replot", str(tmp_path / "old.json"), "--out", str(tmp_path / "replot")]) == 0
    assert (tmp_path / "replot" / "perplexity.md").read_text() == (out / "perplexity.md").read_text()
    assert json.loads((tmp_path / "replot" / "perplexity.json").read_text()) == report
    assert (tmp_path / "replot" / "perplexity.png").stat().st_size > 5000


def test_segment_comparison_on_constructed_rows(script):
    def row(policy, budget, *segments):
        return dict(policy=policy, budget=budget, segments=[dict(perplexity=p) for p in segments])

    rows = [row("full", None, 10.0, 20.0, 30.0), row("unbounded", None, 10.0, 20.0, 30.0),
            row("score", 8, 10.0 * (1 + 1e-7), 19.0, 31.0),  # the first segment: rounding only, no eviction yet
            row("fifo+sinks", 8, 10.0, 19.5, 29.0),
            row("lru", 8),  # a row that failed: no segments
            row("score", 16, 9.0, 20.0, 30.0)]  # no fifo+sinks at 16: no reference
    got = {(c["policy"], c["budget"]): c for c in script.segment_comparison(rows, 1e-4)}
    assert set(got) == {("score", 8), ("fifo+sinks", 8)}
    assert {k: got[("score", 8)][k] for k in ("reference", "lower", "higher", "equal", "segments")} == dict(
        reference="fifo+sinks", lower=1, higher=1, equal=1, segments=3)
    assert {k: got[("fifo+sinks", 8)][k] for k in ("reference", "lower", "higher", "equal")} == dict(
        reference="full", lower=2, higher=0, equal=1)
    table = script.segment_table(list(got.values()), 512, 1e-4)
    assert table[-1] == "| 8 | 1 / 1 / 1 | 2 / 0 / 1 |"


def test_paired_intervals_on_constructed_rows(script):
    """The ratio is the perplexity ratio of the blocks' NLL (a short last block weighs its tokens); a row lower in
    every block has an interval below 0, one that is lower and higher by turns an interval around 0, one equal to
    its reference a zero interval; rows without blocks, or with other blocks, are left out."""
    def row(policy, budget, *blocks):
        return dict(policy=policy, budget=budget, tokens=150, block_nll=list(blocks))

    base = [130.0, 120.0, 125.0, 140.0, 25.0]  # 4 blocks of 32 tokens, then 22
    rows = [row("full", None, *base), row("fifo+sinks", 8, *[x + 2.0 for x in base]),
            row("score", 8, *[x + 2.0 - 0.5 - 0.1 * i for i, x in enumerate(base)]),  # lower in every block
            row("lru", 8, *[x + 2.0 + (3.0 if i % 2 else -3.0) for i, x in enumerate(base)]),  # by turns
            row("fifo+sinks", 16, *base), row("score", 16, *base),  # nothing evicted
            dict(policy="lru", budget=16), row("fifo", 16, 1.0, 2.0)]  # a failed row, other blocks
    got = {(c["policy"], c["budget"]): c for c in script.paired_intervals(rows, 32, resamples=2000)}
    assert set(got) == {("fifo+sinks", 8), ("score", 8), ("lru", 8), ("fifo+sinks", 16), ("score", 16)}
    score = got[("score", 8)]
    assert score["ratio"] == pytest.approx(math.expm1(-sum(0.5 + 0.1 * i for i in range(5)) / 150), rel=1e-12)
    assert score["low"] <= score["ratio"] <= score["high"] < 0 and score["reference"] == "fifo+sinks"
    assert got[("fifo+sinks", 8)]["reference"] == "full" and got[("fifo+sinks", 8)]["low"] > 0
    assert got[("lru", 8)]["low"] < 0 < got[("lru", 8)]["high"]
    assert got[("score", 16)]["ratio"] == got[("score", 16)]["low"] == got[("score", 16)]["high"] == 0
    table = script.interval_table(list(got.values()))
    assert table[-1] == "| 16 | +0.00% [+0.00, +0.00] | +0.00% [+0.00, +0.00] | — |"


def test_missing_plot_or_interval_library_is_reported_before_the_run(script, monkeypatch, tmp_path):
    find_spec = study.importlib.util.find_spec
    monkeypatch.setattr(study.importlib.util, "find_spec", lambda name: None if name == "scipy" else find_spec(name))
    with pytest.raises(SystemExit, match=r'needs scipy: pip install "\.\[eval\]"'):
        script.main(["--quick", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_evaluate_metric_matches_dynamic_cache(reference):
    import evaluate

    metric = evaluate.load(str(METRIC))
    got = metric.compute(predictions=TEXTS, model_id="smollm2", page_size=16, batch_size=2)
    assert set(got) == {"perplexities", "mean_perplexity"}
    model, tok = reference

    def want_ppl(start_token: bool) -> list[float]:
        out = []
        for text in TEXTS:
            ids = tok(text, return_tensors="pt").input_ids[0]
            if start_token:  # the default, as in evaluate's "perplexity": BOS first, every text token scored
                ids = torch.cat([torch.tensor([tok.bos_token_id]), ids])
            nll, count = direct_nll(model, ids)
            out.append(math.exp(nll / count))
        return out

    no_start = metric.compute(predictions=TEXTS, page_size=16, batch_size=2, add_start_token=False)
    for g, w in zip(no_start["perplexities"], want_ppl(False)):
        assert rel(g, w) <= TOL
    want = want_ppl(True)
    assert len(got["perplexities"]) == 2
    for g, w in zip(got["perplexities"], want):
        assert rel(g, w) <= TOL
    assert rel(got["mean_perplexity"], sum(want) / 2) <= TOL
    assert abs(want[0] - want[1]) > 1e-3 * want[0]  # two different texts: a swapped order would show
    one_by_one = metric.compute(predictions=TEXTS, batch_size=1, page_size=5)  # no padding, other page size
    for g, w in zip(one_by_one["perplexities"], want):
        assert rel(g, w) <= TOL
    # a bounded pool that holds both rows whole: the chunked (streaming) path, nothing evicted
    chunked = metric.compute(predictions=TEXTS, batch_size=2, page_size=4, max_pages=16)
    for g, w in zip(chunked["perplexities"], want):
        assert rel(g, w) <= TOL
