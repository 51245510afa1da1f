"""Run NVIDIA kvpress presses on the tasks of scripts/evaluation.py; executed in kvpress's own environment.

kvpress 0.5.5 needs transformers < 5.3 and hf_paged needs >= 5.17, so this script imports nothing
of hf_paged: ``scripts/make_kvpress_env.sh`` makes ``.venv-kvpress``, and ``scripts/evaluation.py
--kvpress`` writes a request (the model folder, the token ids of every case, the budgets) and runs

    .venv-kvpress/bin/python scripts/kvpress_runner.py request.json answer.json

Every press compresses after prefill (what kvpress does): the prompt is prefilled whole, then each
layer keeps ``budget`` tokens per KV head (``compression_ratio = 1 - budget / prompt length``).
Later tokens get explicit positions (the compressed cache's length is not the number of tokens seen).
- continuation: prefill the context with the press, then one forward of the continuation over the
  compressed cache (which grows by the continuation); returns the NLL of every continuation token.
- passkey: prefill the prompt (question included) with the press, then greedy decoding; returns the
  generated token ids.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext

import torch


def presses(names: list[str], ratio: float):
    import kvpress

    made = {"streaming_llm": lambda: kvpress.StreamingLLMPress(compression_ratio=ratio),
            "tova": lambda: kvpress.TOVAPress(compression_ratio=ratio),
            "expected_attention": lambda: kvpress.ExpectedAttentionPress(compression_ratio=ratio),
            "snapkv": lambda: kvpress.SnapKVPress(compression_ratio=ratio)}
    return {name: made[name]() for name in names}


def ratio_for(budget: int, length: int) -> float:
    """kvpress keeps ``int(length * (1 - ratio))`` tokens: half a token of slack makes that ``budget``."""
    return max(0.0, 1.0 - (budget + 0.5) / length)


@torch.no_grad()
def continuation_nll(model, press, ids: list[int], context: int) -> list[float]:
    from transformers import DynamicCache

    x = torch.tensor([ids])
    cache = DynamicCache()
    with press(model) if press is not None else nullcontext():
        first = model(input_ids=x[:, :context], past_key_values=cache, use_cache=True).logits[0, -1:]
    positions = torch.arange(context, x.shape[1] - 1)[None]  # the compressed cache holds fewer: positions go on
    rest = model(input_ids=x[:, context:-1], position_ids=positions, past_key_values=cache, use_cache=True).logits[0]
    logits = torch.cat([first, rest]).float()
    targets = x[0, context:]
    return (-torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].double()).tolist()


@torch.no_grad()
def greedy(model, press, ids: list[int], new_tokens: int) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache()
    with press(model) if press is not None else nullcontext():
        logits = model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]
    out = []
    for i in range(new_tokens):
        token = int(logits.argmax())
        out.append(token)
        logits = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[len(ids) + i]]),
                       past_key_values=cache, use_cache=True).logits[0, -1]
    return out


def main(request_path: str, answer_path: str) -> int:
    import kvpress
    import transformers
    from tqdm.auto import tqdm

    transformers.utils.logging.disable_progress_bar()
    req = json.loads(open(request_path, encoding="utf-8").read())
    torch.set_num_threads(req.get("threads") or torch.get_num_threads())
    model = transformers.AutoModelForCausalLM.from_pretrained(req["model"], dtype=getattr(torch, req["dtype"]),
                                                              attn_implementation="sdpa").eval()
    answer = dict(versions=dict(kvpress=getattr(kvpress, "__version__", "0.5.5"), transformers=transformers.__version__,
                                torch=torch.__version__), continuation=[], passkey=[])
    cont = req.get("continuation")
    if cont:
        jobs = [(name, b) for b in cont["budgets"] for name in req["presses"]]
        for name, budget in tqdm(jobs, desc="kvpress continuation", disable=req.get("quiet")):
            press = presses([name], ratio_for(budget, cont["context"]))[name]
            nll = [continuation_nll(model, press, ids, cont["context"]) for ids in cont["windows"]]
            answer["continuation"].append(dict(press=name, budget=budget, nll=nll))
    for case in tqdm(req.get("passkey", []), desc="kvpress passkey", disable=req.get("quiet")):
        for name in req["presses"]:
            press = presses([name], ratio_for(case["budget"], len(case["ids"])))[name]
            answer["passkey"].append(dict(case=case["case"], budget=case["budget"], press=name,
                                          tokens=greedy(model, press, case["ids"], req["new_tokens"])))
    open(answer_path, "w", encoding="utf-8").write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: kvpress_runner.py REQUEST.json ANSWER.json")
    sys.exit(main(*sys.argv[1:]))
