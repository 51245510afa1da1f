"""Run NVIDIA kvpress presses on the tasks of scripts/evaluation.py; executed in kvpress's own environment.

kvpress 0.5.5 needs transformers < 5.3 and hf_paged needs >= 5.17, so this script imports nothing of the
hf_paged package: it loads two of its files by path, ``hf_paged/evaluation/nll.py`` (the loop that feeds a cache
and scores tokens, the same one hf_paged's side uses) and ``run_info.py`` (versions), which import only torch and
the standard library. ``scripts/make_kvpress_env.sh`` makes ``.venv-kvpress``, and ``scripts/evaluation.py
--kvpress`` writes a request (the model folder, the token ids of every case, the budgets) and runs

    .venv-kvpress/bin/python scripts/kvpress_runner.py request.json answer.json

Every press but ``decoding_<press>`` compresses after prefill (what kvpress does): the prompt is prefilled whole under
``with press(model)``, then each layer keeps ``budget`` tokens per KV head (``compression_ratio = 1 - budget / prompt
length``). ``decoding_<press>`` is ``DecodingPress(<press>, compression_interval=1, target_size=budget - chunk)``,
kvpress's peer of hf_paged's streaming regime: everything, continuation included, is fed in chunks of ``chunk`` tokens
under the press, and after every forward but the first each layer is cut to ``budget - chunk`` tokens by
``<press>``'s scores, so that the next forward, its chunk written, holds at most ``budget`` (the regime's bound).
``adakv_<press>`` is ``AdaKVPress(<press>)``: the layer's ``budget x KV heads`` tokens chosen across its heads (each
head at least 20% of ``budget``, kvpress's ``alpha_safeguard``); it masks the keys it prunes (kvpress's attention
patch, in every later forward) instead of removing them, so its cache holds the whole context and its rows are run
the real way, per budget.
Later tokens get explicit positions (the compressed cache's length is not the number of tokens seen).
- continuation: prefill the context with the press, then one forward of the continuation over the
  compressed cache (which grows by the continuation); returns the NLL of every continuation token and the tokens
  the cache held per layer after the prefill (``decoding_<press>``: the most keys a forward attended over).
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


# the prefixes of hf_paged.evaluation.long_context.PRESSES: AdaKVPress / DecodingPress around the press named after
ADAKV, DECODING = "adakv_", "decoding_"


def make_press(name: str, budget: int, length: int, chunk: int):
    """The kvpress press ``name`` keeping ``budget`` of ``length`` prompt tokens (`ratio_for`); ``adakv_<press>``:
    AdaKVPress around ``<press>``; ``decoding_<press>``: DecodingPress cutting every forward to ``budget - chunk``."""
    import kvpress

    single = {"streaming_llm": kvpress.StreamingLLMPress, "tova": kvpress.TOVAPress,
              "expected_attention": kvpress.ExpectedAttentionPress, "snapkv": kvpress.SnapKVPress}
    if name.startswith(DECODING):
        return kvpress.DecodingPress(single[name[len(DECODING):]](), compression_interval=1,
                                     target_size=budget - chunk)
    if name.startswith(ADAKV):
        return kvpress.AdaKVPress(single[name[len(ADAKV):]](compression_ratio=ratio_for(budget, length)))
    return single[name](compression_ratio=ratio_for(budget, length))


def ratio_for(budget: int, length: int) -> float:
    """kvpress keeps ``int(length * (1 - ratio))`` tokens: half a token of slack makes that ``budget``."""
    return max(0.0, 1.0 - (budget + 0.5) / length)


class PressedStream(nll.CacheStream):
    """A stream over a fresh DynamicCache fed under ``press``: after prefill only, or (``chunk``, a
    ``decoding_<press>``) every forward in chunks of ``chunk`` tokens. ``held``: after a compressing prefill, what
    the cache holds; while streaming, the most keys a forward attended over (held before it + its tokens)."""

    def __init__(self, model, press, chunk: int | None = None):
        from transformers import DynamicCache

        super().__init__(model, DynamicCache(), cache_kwarg="past_key_values")
        self.press, self.chunk, self.held = press, chunk, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.chunk:
            self.held = max(self.held, self.cache.get_seq_length() + ids.shape[1])
        return super().forward(ids)

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` (whole under the press, or in chunks); -> the last token's logits."""
        if self.chunk:  # (under the press already: `continuation_nll`, `greedy`)
            return self.feed(torch.tensor([ids]), self.chunk)[0]
        with self.press(self.model):
            logits = self.feed(torch.tensor([ids]))[0]
        self.held = self.cache.get_seq_length()
        return logits


def stream_for(model, name: str, budget: int, length: int, chunk: int) -> PressedStream:
    press = make_press(name, budget, length, chunk)
    return PressedStream(model, press, chunk if name.startswith(DECODING) else None)


def continuation_nll(stream: PressedStream, ids: list[int], context: int) -> tuple[list[float], int]:
    """(NLL of every token of ``ids[context:]``, tokens held: `PressedStream.held`)."""
    with stream.press(stream.model) if stream.chunk else nullcontext():
        logits = stream.prefill(ids[:context])
        scored = stream.score_after(logits, torch.tensor(ids[context:]), stream.chunk).tolist()
    return scored, stream.held


def greedy(stream: PressedStream, ids: list[int], new_tokens: int) -> list[int]:
    with stream.press(stream.model) if stream.chunk else nullcontext():
        return stream.greedy(stream.prefill(ids), new_tokens)


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
            scored = [continuation_nll(stream_for(model, name, budget, cont["context"], req["chunk"]), ids,
                                       cont["context"]) for ids in cont["windows"]]
            answer["continuation"].append(dict(press=name, budget=budget, nll=[n for n, _ in scored],
                                               held=[h for _, h in scored]))
    for case in tqdm(req.get("passkey", []), desc="kvpress passkey", disable=req.get("quiet")):
        for name in req["presses"]:
            stream = stream_for(model, name, case["budget"], len(case["ids"]), req["chunk"])
            answer["passkey"].append(dict(case=case["case"], budget=case["budget"], press=name,
                                          tokens=greedy(stream, case["ids"], req["new_tokens"])))
    open(answer_path, "w", encoding="utf-8").write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: kvpress_runner.py REQUEST.json ANSWER.json")
    sys.exit(main(*sys.argv[1:]))
