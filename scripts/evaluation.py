"""Long-context evaluation of bounded caches: what a budget of B tokens keeps, on real text.

Tasks (``--tasks``, comma-separated; one core: the same text, model, token ids and cache set-ups):

``continuation``: each of ``--windows`` windows of the text is a context of ``--context`` tokens
  and the next ``--continuation`` tokens; the context is held to a budget B (``--budgets``) and the
  perplexity of the continuation is compared with the full cache's (excess perplexity, pooled NLL), and each
  bounded row with the full cache and the best press of its budget by a paired bootstrap interval over blocks of
  ``--block`` scored tokens.
``passkey``: a pass key hidden at ``--depths`` of a filler text of ``--lengths`` tokens, the question
  after it (inside the prompt; ``--passkey-prompt chat``, the default: in the model's chat template, the assistant's
  answer begun); greedy answer, exact match of the key (``evaluate``), as heatmaps of length x depth per method and
  budget.
``streaming``: perplexity of the first ``--max-tokens`` tokens streamed through one bounded cache
  per policy and budget, through the `evaluate` perplexity module (integrations/perplexity_metric).

Regimes (``--regimes``) of hf_paged's ``PagedCache(max_pages=B // page_size)``:
``streaming``: the text goes in chunks of ``--chunk`` tokens and the cache never holds more than B;
``compress``: the prompt is prefilled whole (``compress_prompt=True``), then cut to B by the attention
  of its last tokens (SnapKV-style); everything after it stays within B;
``compress+grow``: the same cut, then the bound is lifted (``cache.set_max_pages(None)``): what follows
  is added on top of B, as kvpress's presses do (the like-for-like comparison with them).
Policies (``--policies``): ``score`` (default of a bounded cache), ``lru``, ``fifo+sinks``; also ``score+heads``
(``score`` per KV head, ``per_head_eviction=True``, page size 1).

kvpress (``--kvpress auto``): when ``.venv-kvpress`` exists (``scripts/make_kvpress_env.sh``), the same
tasks run there through kvpress's presses (scripts/kvpress_runner.py) on the same model folder and
token ids, and land in the same tables; without it they are reported as not run. ``adakv_snapkv`` and
``adakv_expected_attention`` are kvpress's AdaKVPress (head-wise budgets) around those presses, run per budget
through ``with press(model)``: AdaKV masks the keys it prunes, so its cache holds the whole context.
``decoding_tova`` is kvpress's DecodingPress around TOVA, the streaming regime's peer: the text goes in chunks of
``--chunk`` tokens and every forward but the first is cut to B - chunk by the last token's attention, so that no
forward holds more than B; the other presses' caches also hold the continuation. (StreamingLLM cannot stream
this way: kvpress keeps the kept keys in score order, not position order, and StreamingLLM finds the oldest by index.)

Page formats (``--kv-format float,int8,int4``): every quantized format adds an unbounded PagedCache row (what the
format alone costs against the full cache) and its own bounded rows (``PagedCache(kv_format=...)``).

Several processes (``accelerate launch ... scripts/evaluation.py``) split the jobs round-robin; only
the main process writes ``--out`` (default runs/evaluate)/evaluate.md, evaluate.json, continuation.png,
passkey.png (and jobs.json, every job's raw result, first). ``--quick``: a few small cases (CI).
The study is `hf_paged.evaluation.long_context`; docs/eviction.md has the stored results and their commands.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from hf_paged import assets  # noqa: E402
from hf_paged.evaluation import long_context as study  # noqa: E402
from hf_paged.evaluation.formats import value_list  # noqa: E402
from hf_paged.demotion import COLD_FORMATS  # noqa: E402
from hf_paged.evaluation.long_context import (DECODING, DEFAULT_POLICIES, PASSKEY_PROMPTS, POLICIES,  # noqa: E402
                                              PRESSES, QUICK, REGIMES, TASKS)
from hf_paged.kv_formats import KV_FORMATS  # noqa: E402

CPU_FORMATS = tuple(f for f in KV_FORMATS if f != "fp8_e4m3")  # fp8 pages need CUDA


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tasks", type=value_list(str), default=",".join(TASKS))
    p.add_argument("--regimes", type=value_list(str), default=",".join(REGIMES))
    p.add_argument("--policies", type=value_list(str), default=",".join(DEFAULT_POLICIES))
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--dtype", choices=sorted(assets.DTYPES), default="float32")
    p.add_argument("--dataset", default=None, help="datasets name or path; none: the embedded Britannica article")
    p.add_argument("--config", default=None)
    p.add_argument("--split", default="train")
    p.add_argument("--column", default="text")
    p.add_argument("--text-file", default=None, help="local text file")
    p.add_argument("--kv-format", type=value_list(str), default="float",
                   help=f"comma-separated page formats of the hf_paged caches, of {', '.join(CPU_FORMATS)}: each "
                   "quantized one adds an unbounded row and its own bounded rows (PagedCache(kv_format=...))")
    p.add_argument("--cold-format", type=value_list(str), default=[],
                   help="comma-separated cold formats (int4, int2, int8): each adds bounded rows of float pages that "
                   "hold B float tokens' bytes per layer, the coldest pages re-quantized to it before any eviction "
                   "(PagedCache(max_pages=B, cold_format=...))")
    p.add_argument("--page-size", type=int, default=1, help="PagedCache page size (1 keeps best when bounded)")
    p.add_argument("--score-decay", type=float, default=None,
                   help="continuation/passkey caches: PagedCache(score_decay=...); none: by page size")
    p.add_argument("--recent-pages", type=int, default=1,
                   help="continuation/passkey caches: PagedCache(recent_pages=...)")
    p.add_argument("--observation-window", type=int, default=None,
                   help="continuation/passkey caches: PagedCache(observation_window=...); none: by page size")
    p.add_argument("--score-heads", choices=("mean", "max"), default=None,
                   help="continuation/passkey caches: PagedCache(score_heads=...); none: by page size")
    p.add_argument("--score-signal", choices=("attention", "output"), default=None,
                   help="continuation/passkey caches of the score policy: PagedCache(score_signal=...); none: by page "
                        "size")
    p.add_argument("--per-layer-eviction", choices=("on", "off"), default="on",
                   help="on: each layer keeps its own pages (the default of a bounded cache); off: the layers of a "
                   "group share one page table, victims chosen by their summed attention")
    p.add_argument("--eviction-interval", type=int, default=None,
                   help="continuation/passkey caches: PagedCache(eviction_interval=...) (page size 1; none: the "
                        "cache's default); its rows are named 'hf_paged <policy>, interval <k>' when k is given")
    p.add_argument("--chunk", type=int, default=16, help="streaming regime: tokens per forward")
    p.add_argument("--windows", type=int, default=6, help="continuation: windows of the text")
    p.add_argument("--context", type=int, default=1504, help="continuation: context tokens per window")
    p.add_argument("--continuation", type=int, default=256, help="continuation: scored tokens per window")
    p.add_argument("--budgets", type=value_list(int), default="128,256,512", help="continuation: budgets (tokens)")
    p.add_argument("--lengths", type=value_list(int), default="512,1280", help="passkey: prompt lengths (tokens)")
    p.add_argument("--depths", type=value_list(float), default="0.1,0.5,0.9", help="passkey: needle depths")
    p.add_argument("--passkey-budgets", type=value_list(int), default="128,256")
    p.add_argument("--passkey-prompt", choices=PASSKEY_PROMPTS, default="chat",
                   help="passkey: the prompt in the model's chat template (the assistant's answer begun), or plain "
                   "text")
    p.add_argument("--trials", type=int, default=2, help="passkey: keys (and filler offsets) per cell")
    p.add_argument("--new-tokens", type=int, default=6, help="passkey: greedy tokens generated")
    p.add_argument("--max-tokens", type=int, default=4096, help="streaming task: tokens of the text")
    p.add_argument("--streaming-budgets", type=value_list(int), default="128,256,512")
    p.add_argument("--kvpress", default="auto", help="'auto' (.venv-kvpress if present), 'off', or a python path")
    p.add_argument("--presses", type=value_list(str), default=",".join(PRESSES),
                   help="kvpress presses; adakv_<press>: AdaKVPress (head-wise budgets) around <press>; "
                   "decoding_<press>: DecodingPress around <press>, streaming (cut back to B after every forward)")
    p.add_argument("--block", type=int, default=64,
                   help="continuation: scored tokens per block of the paired bootstrap intervals")
    p.add_argument("--quick", action="store_true", help="a few small cases (CI)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out", default="runs/evaluate", help="output folder (git-ignored runs/; the stored studies are in "
                   "results/evaluate, docs/eviction.md names their commands)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    for name, allowed in (("tasks", TASKS), ("regimes", REGIMES), ("policies", POLICIES), ("presses", PRESSES),
                          ("cold_format", COLD_FORMATS),
                          ("kv_format", CPU_FORMATS if args.cpu or not torch.cuda.is_available() else KV_FORMATS)):
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {allowed}")
    for b in args.budgets + args.passkey_budgets + args.streaming_budgets:
        if b < args.page_size or b % args.page_size:
            p.error(f"budget {b} must be a multiple of the page size {args.page_size}")
    streaming_presses = [x for x in args.presses if x.startswith(DECODING)]
    if streaming_presses and args.kvpress != "off" and min(args.budgets + args.passkey_budgets) <= args.chunk:
        p.error(f"{streaming_presses} cut every forward to B - --chunk tokens: every budget must exceed --chunk "
                f"({args.chunk}); drop them from --presses or use a smaller --chunk")
    if any(not 0 <= d <= 1 for d in args.depths):
        p.error("--depths must be in [0, 1]")
    if args.score_decay is not None and not 0 <= args.score_decay < 1:
        p.error("--score-decay must be in [0, 1)")
    if (args.observation_window is not None and args.observation_window < 1) or args.recent_pages < 0:
        p.error("--observation-window must be positive and --recent-pages non-negative")
    if min(args.windows, args.context, args.continuation, args.trials, args.chunk, args.new_tokens, args.block) <= 0:
        p.error("--windows, --context, --continuation, --trials, --chunk, --new-tokens, --block must be positive")
    return args


if __name__ == "__main__":
    sys.exit(study.main(parse_args()))
