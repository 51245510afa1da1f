"""Perplexity of a causal LM with DynamicCache vs PagedCache, unbounded and under eviction policies.

Two modes, over any text that ``datasets`` can load (documents joined with "\\n\\n", tokenized once):

``--mode strided`` (the transformers perplexity guide): windows of ``--window`` tokens every
``--stride`` tokens, the overlap masked out of the labels (-100); every window is a fresh cache and
a ``use_cache=True`` forward, so the cache is really written and read. DynamicCache + "sdpa" and
PagedCache + "hf_paged" must agree within ``--tolerance`` (relative).

``--mode streaming`` (StreamingLLM's long-text evaluation): the text goes through ONE cache in
chunks of ``--chunk`` tokens (default: one page), with explicit ``position_ids`` continuing the
processed count; every next token is scored given what the cache still holds plus the chunk. Rows:
DynamicCache (full), PagedCache unbounded (must equal full within ``--tolerance``), and for every
``--budgets`` value B (tokens, ``max_pages = B // page_size``): ``score`` (the default), ``lru``, ``fifo+sinks``
(``sink_pages`` = enough pages for 4 tokens) and ``fifo`` without sinks (``sink_pages=0``).

Examples:
    python scripts/perplexity.py --mode streaming                       # Britannica, 2048 tokens (docs/perplexity.md)
    python scripts/perplexity.py --quick                                # smoke test, 256 tokens
    python scripts/perplexity.py --mode strided --max-tokens 0          # the whole text
    python scripts/perplexity.py --dataset wikitext --config wikitext-2-raw-v1 --split test
    python scripts/perplexity.py --text-file notes.txt --model HuggingFaceTB/SmolLM2-360M

Several processes (``accelerate launch`` or ``torchrun``; one process needs no launcher):
    accelerate launch --config_file integrations/accelerate/cpu_2proc.yaml scripts/perplexity.py
    torchrun --nproc_per_node 2 scripts/perplexity.py --mode strided
The strided windows, and in streaming mode the cache configurations (one stream cannot be cut
without changing what the cache holds), are split between the ranks with
``PartialState.split_between_processes``; NLL sums and token counts come back through
``accelerate.utils.gather_object`` and are added in a fixed order, so the numbers do not depend on
the number of processes. Only the main process writes.

Writes ``--out``/perplexity.md (the table, also printed), perplexity.json (every number, settings,
versions) and perplexity.png. In streaming mode they also count, per ``--segment`` tokens, the segments
where each policy's perplexity is below or above fifo+sinks' at the same budget (and fifo+sinks' below or
above the full cache's): one text's perplexity differences between policies are often a few segments'
doing; and each policy's perplexity relative to that reference with a paired bootstrap interval over
blocks of ``--block`` tokens (an interval that excludes 0: a difference that holds across the text).
``--replot JSON`` rewrites the three files from an earlier perplexity.json without running anything. Exit status 1
when a parity check fails or a row raised. The study is `hf_paged.evaluation.perplexity`; docs/perplexity.md has
the stored results and their commands.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_paged import assets  # noqa: E402
from hf_paged.evaluation import perplexity as study  # noqa: E402
from hf_paged.evaluation.formats import int_list  # noqa: E402
from hf_paged.kv_formats import KV_FORMATS  # noqa: E402
from hf_paged.evaluation.perplexity import DEFAULTS, QUICK  # noqa: E402


# ------------------------------------------------------------------------------------ arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("strided", "streaming"), default="streaming")
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--dtype", choices=sorted(assets.DTYPES), default="float32")
    p.add_argument("--dataset", default=None, help="datasets name or path; none: the embedded Britannica article")
    p.add_argument("--config", default=None, help="dataset config name")
    p.add_argument("--split", default="train")
    p.add_argument("--column", default="text")
    p.add_argument("--text-file", default=None, help="local text file, one document per paragraph")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"use the first N tokens of the text (0: all; default {DEFAULTS['max_tokens']}, "
                        f"--quick {QUICK['max_tokens']})")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-format", default="float", choices=KV_FORMATS,
                   help="page format of every PagedCache (hf_paged.kv_formats): float (the model's dtype), int8, int4, "
                        "fp8_e4m3 (CUDA)")
    p.add_argument("--prefix-store", default=None, help="a prefix store under every PagedCache (a folder, file:///dir "
                   "or redis://host:port/db; docs/prefix_store.md): each cache writes its full pages to it; a forward "
                   "that scores every token reuses none, so perplexity is unchanged; the store counters are printed "
                   "and recorded in perplexity.json")
    p.add_argument("--window", type=int, default=512, help="strided: tokens per window")
    p.add_argument("--stride", type=int, default=256, help="strided: window step (the scored tokens per window)")
    p.add_argument("--chunk", type=int, default=None, help="streaming: tokens per forward; none: one page")
    p.add_argument("--budgets", type=int_list, default=None,
                   help=f"streaming: KV budgets in tokens, max_pages = budget // page size (default "
                        f"{DEFAULTS['budgets']}, --quick {QUICK['budgets']})")
    p.add_argument("--quick", action="store_true",
                   help="smoke test (seconds, not a result): the --quick values of --max-tokens and --budgets")
    p.add_argument("--lru-threshold", type=float, default=None,
                   help="streaming: PagedCache(lru_threshold=...) for the lru rows; none: PagedCache's default")
    p.add_argument("--per-head", action="store_true", help="streaming: also a 'score+heads' row per budget, the "
                   "score policy per KV head (PagedCache(per_head_eviction=True); needs --page-size 1)")
    p.add_argument("--segment", type=int, default=512, help="streaming: also report perplexity per segment of N tokens")
    p.add_argument("--block", type=int, default=64, help="streaming: tokens per block of the paired bootstrap "
                   "interval of each policy's perplexity against its reference's")
    p.add_argument("--tolerance", type=float, default=1e-4, help="relative tolerance of the parity checks")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process; none: torch's default")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if GPUs are present")
    p.add_argument("--out", default="runs/perplexity",
                   help="output folder (git-ignored runs/; the stored studies are in results/perplexity, "
                   "docs/perplexity.md names their commands)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="run nothing: rewrite perplexity.md/.json/.png in --out from an earlier perplexity.json")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, int_list(value) if key == "budgets" else value)
    for name in ("page_size", "window", "stride", "segment", "block"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.chunk is None:
        args.chunk = args.page_size
    if args.chunk <= 0:
        p.error("--chunk must be positive")
    if args.stride > args.window:
        p.error("--stride must not exceed --window (tokens would be skipped)")
    if args.max_tokens < 0:
        p.error("--max-tokens must be >= 0")
    if args.per_head and args.page_size != 1:
        p.error("--per-head needs --page-size 1 (a head page holds one token of one KV head)")
    if args.mode == "streaming" and min(args.budgets) < args.page_size:
        p.error(f"--budgets must be at least one page ({args.page_size} tokens)")
    return args


if __name__ == "__main__":
    sys.exit(study.main(parse_args()))
