"""scripts/evaluation.py's kvpress side without kvpress or a model: the request handed to scripts/kvpress_runner.py
(AdaKV presses included), its answer turned into rows with paired intervals against the full cache and the best
press, the pass-key prompt in a chat template, and a missing environment reported instead of run."""

import contextlib
import math
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tiny_models import make_config

from hf_paged.evaluation import long_context as study
from script_commands import Command


@pytest.fixture(scope="module")
def script():
    return Command("evaluation", study)


def test_request_names_the_adakv_presses_and_every_window_and_case(script, tmp_path):
    args = script.parse_args(["--model", str(tmp_path), "--tasks", "continuation,passkey", "--windows", "2",
                              "--context", "6", "--continuation", "2", "--budgets", "2,4", "--passkey-budgets", "4",
                              "--presses", "snapkv,adakv_snapkv,adakv_expected_attention"])
    ids = torch.arange(100)
    cases = [dict(case=0, ids=[5, 6, 7]), dict(case=1, ids=[8, 9])]
    req = script.kvpress_request(args, ids, cases)
    assert req["model"] == str(tmp_path) and req["presses"] == ["snapkv", "adakv_snapkv", "adakv_expected_attention"]
    assert req["continuation"] == dict(context=6, budgets=[2, 4], windows=[list(range(8)), list(range(8, 16))])
    assert req["chunk"] == 16  # (the streaming regime's chunk, which decoding_<press> streams in)
    assert req["passkey"] == [dict(case=0, budget=4, ids=[5, 6, 7]), dict(case=1, budget=4, ids=[8, 9])]
    assert "passkey" not in script.kvpress_request(script.parse_args(["--tasks", "continuation", "--model", "m"]),
                                                    ids, cases)


def test_unknown_press_is_refused(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--presses", "adakv_nope"])
    assert "adakv_nope" in capsys.readouterr().err


def test_a_streaming_press_needs_budgets_above_the_chunk(script, capsys):
    """decoding_<press> cuts every forward to B - chunk: a budget not above the chunk is refused before anything runs,
    and is fine without that press or with kvpress off."""
    with pytest.raises(SystemExit):
        script.parse_args(["--presses", "tova,decoding_tova", "--budgets", "16,128", "--chunk", "16"])
    assert "decoding_tova" in capsys.readouterr().err
    for argv in (["--presses", "tova"], ["--presses", "decoding_tova", "--kvpress", "off"]):
        assert script.parse_args([*argv, "--budgets", "16", "--chunk", "16"]).budgets == [16]


def test_missing_kvpress_environment_is_reported_not_run(script, tmp_path):
    args = script.parse_args(["--kvpress", str(tmp_path / "absent" / "python")])
    status, cont, pk = script.run_kvpress(args, torch.arange(10), [])
    assert status["status"].startswith("not run") and "absent" in status["status"] and cont == pk == []


def _nll(level: float, tokens: int, seed: int) -> list[float]:
    g = np.random.default_rng(seed)
    return (level + 0.3 * g.standard_normal(tokens)).tolist()


def test_answer_rows_and_paired_intervals_against_the_full_cache_and_the_best_press(script):
    """Two windows of 8 scored tokens in blocks of 4: the rows keep what the press's cache held after the prefill,
    and each bounded row is compared with the full cache and the lowest-perplexity press of its budget."""
    windows, tokens = 2, 8
    answer = dict(continuation=[
        dict(press="snapkv", budget=4, nll=[_nll(2.3, tokens, w) for w in range(windows)], held=[4, 4]),
        dict(press="adakv_snapkv", budget=4, nll=[_nll(2.2, tokens, 10 + w) for w in range(windows)], held=[6, 6])],
        passkey=[dict(press="adakv_snapkv", budget=4, case=0, tokens=[1, 2])])
    cont, pk = script.kvpress_results(answer)
    assert [(r["method"], r["window"], r["prefill_tokens_held"]) for r in cont] == [
        ("kvpress snapkv", 0, 4), ("kvpress snapkv", 1, 4), ("kvpress adakv_snapkv", 0, 6),
        ("kvpress adakv_snapkv", 1, 6)]
    assert pk == [dict(task="passkey", method="kvpress adakv_snapkv", regime="compress+grow", budget=4, case=0,
                       tokens=[1, 2], peak_tokens_held=None)]
    assert [len(r["block_nll"]) for r in cont] == [1] * 4
    assert cont[0]["block_nll"][0] == pytest.approx(cont[0]["nll_sum"])
    hf = [dict(method=m, regime=g, budget=b, window=w, nll=nll, nll_sum=math.fsum(nll), tokens=tokens,
               peak_tokens_held=b or 0, evictions=1)
          for m, g, b, level in (("full", "full", None, 2.0), ("hf_paged score", "streaming", 4, 2.1))
          for w, nll in enumerate(_nll(level, tokens, 20 + w) for w in range(windows))]
    summary = script.summarize_continuation(hf + cont, dict(status="ok"), block=4)
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["kvpress adakv_snapkv"]["prefill_tokens_held"] == 6 and "prefill_tokens_held" not in rows["full"]
    paired = {(p["method"], p["against"]): p for p in summary["paired"]}
    assert set(paired) == {("hf_paged score", "full"), ("hf_paged score", "best press"), ("kvpress snapkv", "full"),
                           ("kvpress snapkv", "best press"), ("kvpress adakv_snapkv", "full")}
    assert paired[("hf_paged score", "best press")]["reference"] == "kvpress adakv_snapkv"  # the lower perplexity
    for (method, against), p in paired.items():
        ref = rows["full" if against == "full" else p["reference"]]
        assert p["ratio"] == pytest.approx(rows[method]["perplexity"] / ref["perplexity"] - 1)
        assert p["low"] <= p["ratio"] <= p["high"] and p["blocks"] == windows * tokens // 4
    text = "\n".join(script.paired_tables(summary, [4]))
    assert "the best press of each budget (B=4: kvpress adakv_snapkv)" in text
    assert "| kvpress adakv_snapkv | 6 |" in text and "best streaming press" not in text


def test_a_decoding_press_streams_and_is_the_streaming_rows_like_for_like_reference(script):
    """``decoding_<press>`` rows are of the streaming regime and keep the most keys a forward attended over; each
    streaming row is also paired with the best streaming press of its budget (the press-wide best may be another)."""
    windows, tokens = 2, 8
    answer = dict(continuation=[
        dict(press="snapkv", budget=4, nll=[_nll(2.0, tokens, w) for w in range(windows)], held=[4, 4]),
        dict(press="decoding_tova", budget=4, nll=[_nll(2.2, tokens, 10 + w) for w in range(windows)], held=[5, 6])],
        passkey=[dict(press="decoding_tova", budget=4, case=0, tokens=[3])])
    cont, pk = script.kvpress_results(answer)
    assert [(r["regime"], r["peak_tokens_held"], "prefill_tokens_held" in r) for r in cont] == [
        ("compress+grow", None, True), ("compress+grow", None, True), ("streaming", 5, False), ("streaming", 6, False)]
    assert pk[0]["regime"] == "streaming"
    hf = [dict(method=m, regime=g, budget=b, window=w, nll=nll, nll_sum=math.fsum(nll), tokens=tokens,
               peak_tokens_held=b or 0, evictions=1)
          for m, g, b, level in (("full", "full", None, 1.9), ("hf_paged score", "streaming", 4, 2.1),
                                 ("hf_paged score", "compress+grow", 4, 2.1))
          for w, nll in enumerate(_nll(level, tokens, 20 + w) for w in range(windows))]
    summary = script.summarize_continuation(hf + cont, dict(status="ok"), block=4)
    rows = {(r["method"], r["regime"]): r for r in summary["rows"]}
    assert rows[("kvpress decoding_tova", "streaming")]["peak_tokens_held"] == 6
    paired = {(p["method"], p["regime"], p["against"]): p for p in summary["paired"]}
    streaming = paired[("hf_paged score", "streaming", "best streaming press")]
    assert streaming["reference"] == "kvpress decoding_tova"
    assert paired[("hf_paged score", "streaming", "best press")]["reference"] == "kvpress snapkv"
    assert ("hf_paged score", "compress+grow", "best streaming press") not in paired  # (only streaming rows)
    ref = rows[("kvpress decoding_tova", "streaming")]
    mine = rows[("hf_paged score", "streaming")]["perplexity"]
    assert streaming["ratio"] == pytest.approx(mine / ref["perplexity"] - 1)
    assert "the best streaming press of each budget (B=4: kvpress decoding_tova)" in "\n".join(
        script.paired_tables(summary, [4]))


class CharTokenizer:
    """One token per character; a chat template that wraps the user's turn in markers."""

    chat_template = "user/assistant"

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = torch.tensor([[ord(c) for c in text]])
        return type("Encoded", (), dict(input_ids=ids))()

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert not tokenize and add_generation_prompt and messages[0]["role"] == "user"
        return f"<user>{messages[0]['content']}</user><assistant>"


@pytest.mark.parametrize("style", ["chat", "plain"])
def test_passkey_prompt_styles_have_the_length_the_key_and_the_frame(script, style):
    args = script.parse_args(["--lengths", "300", "--depths", "0.5", "--trials", "2", "--passkey-prompt", style])
    cases = script.passkey_cases(args, CharTokenizer(), torch.full((2000,), ord("x")))
    for c in cases:
        text = "".join(map(chr, c["ids"]))
        assert len(c["ids"]) == 300 and c["key"] in text
        if style == "chat":
            assert text.startswith("<user>" + script.PROMPT)
            assert text.endswith(script.CHAT_QUESTION + "</user><assistant>" + script.CHAT_ANSWER)
        else:
            assert text.startswith(script.PROMPT) and text.endswith(script.QUESTION) and "<user>" not in text


def test_chat_prompt_without_a_chat_template_says_what_to_do(script):
    tokenizer = CharTokenizer()
    tokenizer.chat_template = None
    with pytest.raises(SystemExit, match="--passkey-prompt plain"):
        script.passkey_frame(tokenizer, "chat")


class WindowPress:
    """A stand-in for a kvpress DecodingPress: under ``with press(model)`` every forward but the first ends with each
    layer of the cache cut to its last ``budget`` tokens."""

    def __init__(self, budget: int):
        self.budget, self.cache, self.forwards = budget, None, 0

    @contextlib.contextmanager
    def __call__(self, model):
        def cut(module, args, kwargs, output):
            self.forwards += 1
            for layer in kwargs["past_key_values"].layers if self.forwards > 1 else ():
                layer.keys, layer.values = layer.keys[:, :, -self.budget:], layer.values[:, :, -self.budget:]

        handle = model.register_forward_hook(cut, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


def test_runner_streams_a_decoding_press_in_chunks_and_counts_the_keys_a_forward_attends_over():
    """scripts/kvpress_runner.py with a stand-in press: a streaming press sees every forward (context and
    continuation, in chunks) and ``held`` is the most keys a forward attended over (budget + chunk); a prefill press
    sees the prefill only and ``held`` is what its cache kept."""
    runner = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "kvpress_runner.py"))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config("llama"), attn_implementation="sdpa").eval()
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    streaming = runner["PressedStream"](model, WindowPress(budget=6), chunk=4)
    nll, held = runner["continuation_nll"](streaming, ids, context=20)
    assert len(nll) == 10 and held == 6 + 4 and streaming.press.forwards == 8  # 5 context + 3 continuation forwards
    assert streaming.cache.get_seq_length() == 6
    prefilled = runner["PressedStream"](model, WindowPress(budget=6))
    nll, held = runner["continuation_nll"](prefilled, ids, context=20)
    assert len(nll) == 10 and held == 20 and prefilled.press.forwards == 1  # (the first forward is never cut)
    assert prefilled.cache.get_seq_length() == 29  # the continuation (but its last token) grows it, unpressed
