#!/usr/bin/env python
"""Speed and memory of `hf_paged.PagedCache` + "hf_paged" attention against `DynamicCache` + "sdpa".

One model is loaded once; for every configuration the two caches run alternately (a short warm-up
of each first, then ``--repeats`` timed runs, the order flipped every repeat) on real text: prompts
cut from the Britannica article (``hf_paged.assets.britannica_text``) at exactly the context length
in tokens, one distinct slice per batch row. The table reports medians over the repeats.

What is measured, per ``generate`` run (a LogitsProcessor is called once per forward step):

* prefill tokens/s: rows x context / (time from calling ``generate`` to the first logits processor
  call, i.e. the prefill forward plus generate's setup);
* decode tokens/s: rows x (new_tokens - 1) / (time from the first to the last processor call),
  i.e. per generated token, prefill excluded. The processor's own bookkeeping time is subtracted.
  "rows" is what the model computes: batch, x beams (beamN) or x returned sequences (sampleN);
  generate expands the prompts before prefill, so prefill processes rows x context tokens too;
* KV bytes at the end (DynamicCache: nbytes of every layer's keys and values; PagedCache:
  ``stats()["kv_bytes"]``, the used + cached pages) and their peak over the steps (sampled after
  every forward step); for PagedCache also the allocated pool (``pool_bytes``);
* process memory: see ``memory_method`` in the JSON. On Linux/CPU, before every run the garbage
  collector and ``malloc_trim(0)`` return freed memory to the OS and the peak-RSS counter (VmHWM)
  is reset through /proc/self/clear_refs; the run's "peak RSS growth" is VmHWM after the run minus
  VmRSS before it, so each run is measured on its own although all run in one process. On CUDA
  it is torch.cuda.max_memory_allocated() minus memory_allocated() before the run.
* tokens_match: the paged run produced exactly the dynamic run's tokens, in every repeat
  (sampling uses the same seed for both).
* with ``--budget``, greedy configurations: after the whole runs, one round per repeat in which the
  unbounded and the bounded PagedCache decode taking turns token by token; per step the ratio of
  their times (median and quartiles), which load drifting over seconds does not skew.
* with ``--alternate``, greedy configurations: the same rounds for DynamicCache + sdpa against PagedCache +
  hf_paged (the model switches attention between their steps): the paged step's speed against DynamicCache's,
  per step, where whole runs are too noisy to tell a few percent.

Outputs: a markdown table on stdout and, in ``--out`` (default runs/benchmark, git-ignored), benchmark.md,
benchmark.json (every number, settings, versions) and benchmark.png (decode speed and peak KV
memory as ratios against DynamicCache, by context). A speed ratio whose repetitions spread by more
than 20% (either cache) is printed as "noisy", not as a result. ``--many-prompts`` runs
scripts/many_prompts.py instead (its flags follow). The study is `hf_paged.evaluation.benchmark`;
docs/benchmark.md has the stored results and their commands.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_paged.evaluation import benchmark as study  # noqa: E402
from hf_paged.evaluation.benchmark import (  # noqa: E402
    ALL_BATCH_SIZES, ALL_CONTEXTS, ALL_MODES, ALL_PAGE_SIZES, BASE, DEFAULT_SET, DEFAULTS, QUICK, QUICK_SET, mode_list)
from hf_paged.evaluation.formats import int_list  # noqa: E402
from hf_paged.kv_formats import KV_FORMATS  # noqa: E402

HELP_EPILOG = f"""\
configurations:
  With none of --contexts/--batch-sizes/--modes/--page-sizes, the default covering set runs
  ({len(DEFAULT_SET)} configurations, each value of each axis at least once):
{chr(10).join(f'    context {c:>5}  batch {b}  {m:<8} page size {p}' for c, b, m, p in DEFAULT_SET)}
  i.e. greedy at every context with batch 1 and at 256/1k with batch 8, beam search (4 beams) and
  8 sampled returns at 1k batch 1, page size 128 at 4k. With --new-tokens 32 --repeats 3 it took
  8 minutes on 2 idle cores (torch's default of 2 threads), 33 minutes on a 2-core machine shared
  with other jobs (--threads 1, load average 4-8). Prefills dominate (1k x 8 rows and the 4k contexts).
  On a busy machine pass --threads 1: torch's default of one thread per core then collapses
  (10x slower) under oversubscription.
  Giving some axis flags runs the cross product of the given lists, with the axes left out at
  context {BASE['context']}, batch {BASE['batch']}, {BASE['mode']}, page size {BASE['page_size']}.
  --full runs the cross product of all lists (defaults: contexts {','.join(map(str, ALL_CONTEXTS))},
  batch sizes {','.join(map(str, ALL_BATCH_SIZES))},
  modes {','.join(ALL_MODES)}, page sizes {','.join(map(str, ALL_PAGE_SIZES))}).
  --quick (smoke test, about a minute on 2 cores): {len(QUICK_SET)} tiny configurations (contexts 32/64,
  batch 1/2, greedy/beam4/sample8, page sizes 16/8), --new-tokens {QUICK['new_tokens']}, --repeats {QUICK['repeats']};
  axis flags still replace its set.

modes: greedy, beamN (beam search with N beams, 1 sequence returned), sampleN (sampling,
  N sequences returned per prompt; same seed for both caches).
"""



def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="benchmark.py", description=__doc__.split("\n\n")[0], epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--many-prompts", action="store_true", help="instead: generate_many against generate and "
                   "transformers' continuous batching on many prompts (scripts/many_prompts.py; see its --help)")
    p.add_argument("--model", default=None, help="'smollm2' (default, the embedded SmolLM2-135M), a local path "
                   "or a hub id (the hub needs HF_HUB_OFFLINE=0)")
    p.add_argument("--contexts", type=int_list, default=None, help="prompt lengths in tokens, e.g. 256,1024,4096")
    p.add_argument("--batch-sizes", type=int_list, default=None, help="prompts per batch, e.g. 1,8")
    p.add_argument("--modes", type=mode_list, default=None, help="e.g. greedy,beam4,sample8")
    p.add_argument("--page-sizes", type=int_list, default=None, help="PagedCache page sizes, e.g. 16,128")
    p.add_argument("--kv-format", default="float", choices=KV_FORMATS,
                   help="page format of every PagedCache (hf_paged.kv_formats): float (the model's dtype), int8, int4, "
                        "fp8_e4m3 (CUDA)")
    p.add_argument("--prefix-store", default=None, help="a prefix store under every PagedCache (a folder, file:///dir "
                   "or redis://host:port/db; docs/prefix_store.md), shared by the runs: a run after the first of a "
                   "configuration loads its prompt from the store, so prefill figures then measure the store; the "
                   "store counters of all runs are printed at the end and recorded in benchmark.json")
    p.add_argument("--full", action="store_true", help="cross product of all axis lists")
    p.add_argument("--new-tokens", type=int, default=None,
                   help=f"tokens generated per row (default {DEFAULTS['new_tokens']}; --quick {QUICK['new_tokens']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed runs per cache and configuration (default {DEFAULTS['repeats']}; --quick "
                        f"{QUICK['repeats']})")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed warm-up runs per cache and configuration (default 1), with the configuration's "
                        "batch, mode and page size on a prompt of min(context, 64) tokens and 4 new tokens")
    p.add_argument("--full-warmup", action="store_true", help="warm up with the full configuration instead")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny contexts, 1 repeat, few tokens (~1 min)")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for both caches)")
    p.add_argument("--budget", type=int, default=None, help="also time a bounded PagedCache holding at most this "
                   "many tokens per row (max_pages = budget // page size per decoded row, the default eviction "
                   "policy; a longer prompt is cut to it after prefill, compress_prompt=True), alternated "
                   "with the other two; the table adds its decode speed against the unbounded PagedCache, from "
                   "the whole runs and, for greedy configurations, from rounds (one per repeat) in which the two "
                   "PagedCaches decode taking turns token by token")
    p.add_argument("--budget-page-size", type=int, default=None, help="page size of the bounded PagedCache "
                   "(default: the configuration's; 1 keeps best when bounded, docs/eviction.md)")
    p.add_argument("--budget-eviction", default=None, choices=["score", "lru", "fifo"], help="eviction policy of the "
                   "bounded PagedCache (default: PagedCache's, score)")
    p.add_argument("--budget-per-layer", default=None, choices=["on", "off"], help="per_layer_eviction of the bounded "
                   "PagedCache (default: PagedCache's: on for score and lru)")
    p.add_argument("--per-head", action="store_true", help="the bounded PagedCache evicts per KV head "
                   "(per_head_eviction=True; needs --budget-page-size 1)")
    p.add_argument("--budget-score-signal", default=None, choices=["attention", "output"], help="score_signal of the "
                   "bounded PagedCache (default: PagedCache's; with the prompt cut after prefill, attention)")
    p.add_argument("--budget-eviction-interval", type=int, default=None, help="eviction_interval of the bounded "
                   "PagedCache: victims chosen every k steps, k at once (needs --budget-page-size 1; default: "
                   "PagedCache's, 8 for pages of 1 under the score policy)")
    p.add_argument("--alternate", action="store_true", help="also, for greedy configurations, rounds (one per "
                   "repeat) in which DynamicCache and PagedCache decode taking turns token by token: the per-step "
                   "speed ratio, median and quartiles")
    p.add_argument("--out", default="runs/benchmark", help="output folder (default runs/benchmark, git-ignored; the "
                   "stored studies are in results/benchmark, docs/benchmark.md names their commands)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="run nothing: rewrite benchmark.md/.png in --out from an earlier benchmark.json")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (decode speed needs at least one step after prefill)")
    if args.budget is not None and args.budget < 1:
        p.error("--budget must be a positive number of tokens")
    if args.budget_page_size is not None and (args.budget is None or args.budget_page_size < 1):
        p.error("--budget-page-size needs --budget and must be a positive int")
    if (args.budget_eviction or args.budget_per_layer or args.budget_score_signal or args.per_head
            or args.budget_eviction_interval) and args.budget is None:
        p.error("--budget-eviction, --budget-per-layer, --budget-score-signal, --budget-eviction-interval and "
                "--per-head need --budget")
    if args.repeats < 1 or args.warmup < 0:
        p.error("--repeats must be >= 1 and --warmup >= 0")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--many-prompts" in argv:  # the many-prompts comparison is its own command, with its own flags
        sys.argv = [str(Path(__file__).with_name("many_prompts.py")), *(a for a in argv if a != "--many-prompts")]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return None
    return study.main(parse_args(argv), argv)


if __name__ == "__main__":
    main()
