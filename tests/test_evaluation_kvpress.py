"""scripts/evaluation.py's kvpress side without kvpress or a model: the request handed to scripts/kvpress_runner.py
(AdaKV presses included), its answer turned into rows with paired intervals against the full cache and the best
press, the pass-key prompt in a chat template, and a missing environment reported instead of run."""

import math

import numpy as np
import pytest
import torch

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
    assert req["passkey"] == [dict(case=0, budget=4, ids=[5, 6, 7]), dict(case=1, budget=4, ids=[8, 9])]
    assert "passkey" not in script.kvpress_request(script.parse_args(["--tasks", "continuation", "--model", "m"]),
                                                    ids, cases)


def test_unknown_press_is_refused(script, capsys):
    with pytest.raises(SystemExit):
        script.parse_args(["--presses", "adakv_nope"])
    assert "adakv_nope" in capsys.readouterr().err


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
    assert pk == [dict(method="kvpress adakv_snapkv", regime="compress+grow", budget=4, case=0, tokens=[1, 2],
                       peak_tokens_held=None)]
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
    assert "| kvpress adakv_snapkv | 6 |" in text


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
