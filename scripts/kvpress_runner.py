"""Run NVIDIA kvpress presses on the tasks of scripts/evaluation.py; executed in kvpress's own environment.

kvpress 0.5.5 needs transformers < 5.3 and hf_paged needs >= 5.17, so this script imports nothing of the
hf_paged package: it loads two of its files by path, ``hf_paged/evaluation/nll.py`` (the loop that feeds a cache
and scores tokens, the same one hf_paged's side uses) and ``run_info.py`` (versions), which import only torch and
the standard library. ``scripts/make_kvpress_env.sh`` makes ``.venv-kvpress``, and ``scripts/evaluation.py
--kvpress`` writes a request (the model folder, the token ids of every case, the budgets) and runs

    .venv-kvpress/bin/python scripts/kvpress_runner.py request.json answer.json

Every press compresses after prefill (what kvpress does): the prompt is prefilled whole under ``with press(model)``,
then each layer keeps ``budget`` tokens per KV head (``compression_ratio = 1 - budget / prompt length``).
``adakv_<press>`` is ``AdaKVPress(<press>)``: the layer's ``budget x KV heads`` tokens chosen across its heads (each
head at least 20% of ``budget``, kvpress's ``alpha_safeguard``); it masks the keys it prunes (kvpress's attention
patch, in every later forward) instead of removing them, so its cache holds the whole context and its rows are run
the real way, per budget.
Later tokens get explicit positions (the compressed cache's length is not the number of tokens seen).
- continuation: prefill the context with the press, then one forward of the continuation over the
  compressed cache (which grows by the continuation); returns the NLL of every continuation token and the tokens
  the cache held per layer after the prefill.
- passkey: prefill the prompt (question included) with the press, then greedy decoding; returns the
  generated token ids.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

EVALUATION = Path(__file__).resolve().parents[1] / "hf_paged" / "evaluation"


def load(name: str):
    """``hf_paged/evaluation/<name>.py`` as a module of its own, without importing the hf_paged package."""
    spec = importlib.util.spec_from_file_location(f"kvpress_runner_{name}", EVALUATION / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nll = load("nll")


ADAKV = "adakv_"  # as in hf_paged.evaluation.long_context: AdaKVPress around the press named after it


def make_press(name: str, ratio: float):
    """The kvpress press ``name`` at ``compression_ratio=ratio``; ``adakv_<press>``: AdaKVPress around ``<press>``."""
    import kvpress

    single = {"streaming_llm": kvpress.StreamingLLMPress, "tova": kvpress.TOVAPress,
              "expected_attention": kvpress.ExpectedAttentionPress, "snapkv": kvpress.SnapKVPress}
    if name.startswith(ADAKV):
        return kvpress.AdaKVPress(single[name[len(ADAKV):]](compression_ratio=ratio))
    return single[name](compression_ratio=ratio)


def ratio_for(budget: int, length: int) -> float:
    """kvpress keeps ``int(length * (1 - ratio))`` tokens: half a token of slack makes that ``budget``."""
    return max(0.0, 1.0 - (budget + 0.5) / length)


def pressed_prefill(model, press, ids: list[int]):
    """A stream over a fresh DynamicCache with ``ids`` prefilled under ``press``: (stream, last token's logits)."""
    from transformers import DynamicCache

    stream = nll.CacheStream(model, DynamicCache(), cache_kwarg="past_key_values")
    with press(model) if press is not None else nullcontext():
        logits = stream.feed(torch.tensor([ids]))[0]
    return stream, logits


def continuation_nll(model, press, ids: list[int], context: int) -> tuple[list[float], int]:
    """(NLL of every token of ``ids[context:]``, tokens the cache held per layer after the pressed prefill)."""
    stream, logits = pressed_prefill(model, press, ids[:context])
    held = stream.cache.get_seq_length()
    return stream.score_after(logits, torch.tensor(ids[context:])).tolist(), held


def greedy(model, press, ids: list[int], new_tokens: int) -> list[int]:
    stream, logits = pressed_prefill(model, press, ids)
    return stream.greedy(logits, new_tokens)


def main(request_path: str, answer_path: str) -> int:
    import transformers
    from tqdm.auto import tqdm

    transformers.utils.logging.disable_progress_bar()
    req = json.loads(open(request_path, encoding="utf-8").read())
    torch.set_num_threads(req.get("threads") or torch.get_num_threads())
    model = transformers.AutoModelForCausalLM.from_pretrained(req["model"], dtype=getattr(torch, req["dtype"]),
                                                              attn_implementation="sdpa").eval()
    answer = dict(versions=load("run_info").versions(("kvpress", "transformers", "torch")), continuation=[],
                  passkey=[])
    cont = req.get("continuation")
    if cont:
        jobs = [(name, b) for b in cont["budgets"] for name in req["presses"]]
        for name, budget in tqdm(jobs, desc="kvpress continuation", disable=req.get("quiet")):
            press = make_press(name, ratio_for(budget, cont["context"]))
            scored = [continuation_nll(model, press, ids, cont["context"]) for ids in cont["windows"]]
            answer["continuation"].append(dict(press=name, budget=budget, nll=[n for n, _ in scored],
                                               held=[h for _, h in scored]))
    for case in tqdm(req.get("passkey", []), desc="kvpress passkey", disable=req.get("quiet")):
        for name in req["presses"]:
            press = make_press(name, ratio_for(case["budget"], len(case["ids"])))
            answer["passkey"].append(dict(case=case["case"], budget=case["budget"], press=name,
                                          tokens=greedy(model, press, case["ids"], req["new_tokens"])))
    open(answer_path, "w", encoding="utf-8").write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: kvpress_runner.py REQUEST.json ANSWER.json")
    sys.exit(main(*sys.argv[1:]))
