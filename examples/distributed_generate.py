"""Data-parallel generation over a prompt set: one process per GPU (or CPU process), one PagedCache each.

GPUs (one process per GPU):
    accelerate launch --multi_gpu --num_processes 4 examples/distributed_generate.py --out runs/gen.jsonl
    accelerate launch --config_file integrations/accelerate/multi_gpu.yaml examples/distributed_generate.py

CPU only, 2 processes over gloo (NOT `accelerate launch --cpu --num_processes 2`: in accelerate
1.15 that starts a single process):
    accelerate launch --config_file integrations/accelerate/cpu_2proc.yaml examples/distributed_generate.py
    accelerate launch --multi_gpu --num_processes 2 examples/distributed_generate.py    # same thing
    torchrun --standalone --nproc_per_node 2 examples/distributed_generate.py   # --standalone: a free port

One process: python examples/distributed_generate.py

Prompts: by default ``--num-prompts`` excerpts of the embedded Britannica article (no network);
else the ``--column`` of a ``datasets`` dataset (``--dataset/--config/--split``) or of a local
``--text-file`` (one row per paragraph). Greedy unless ``--do-sample``.

Writes ``--out`` (default runs/distributed_generate.jsonl, git-ignored; JSONL, one line per prompt in input
order: index, prompt, completion, tokens, prompt_tokens; the same bytes whatever the number of processes, greedy)
and ``<out>.summary.json`` (per-rank and total tokens/s, KV statistics), and prints the summary.

Threads: each process uses ``--threads`` torch threads; by default $OMP_NUM_THREADS, else the idle cores (cores
minus the load average) divided among the processes on a CPU (oversubscribed OpenMP threads are 5-10x slower).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import hf_paged  # noqa: E402,F401  (registers the "hf_paged" attention)
from hf_paged import assets  # noqa: E402
from hf_paged.distributed import format_summary, generate_distributed, make_state  # noqa: E402
from hf_paged.evaluation.run_info import idle_cores  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--dtype", choices=sorted(assets.DTYPES), default="float32")
    p.add_argument("--dataset", default=None, help="datasets name or path (default: embedded Britannica prompts)")
    p.add_argument("--config", default=None, help="dataset config name")
    p.add_argument("--split", default="train")
    p.add_argument("--column", default="text")
    p.add_argument("--text-file", default=None, help="local text file, one prompt per paragraph")
    p.add_argument("--num-prompts", type=int, default=16, help="prompts to generate (dataset: the first N rows)")
    p.add_argument("--min-words", type=int, default=20, help="Britannica prompts: shortest prompt, in words")
    p.add_argument("--max-words", type=int, default=120, help="Britannica prompts: longest prompt, in words")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="tokens per continuous-batching step, per process")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-pages", type=int, default=None, help="bound each process' page pool (default: grows)")
    p.add_argument("--prefix-store", default=None, help="a prefix store every process shares: a folder, file:///dir "
                   "or redis://host:port/db (docs/prefix_store.md)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="prompt selection; sampling seed (+ prompt index)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if GPUs are present (gloo)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: $OMP_NUM_THREADS, "
                   "else on a CPU the idle cores divided among the processes)")
    p.add_argument("--out", default="runs/distributed_generate.jsonl", help="JSONL output path (runs/ is git-ignored)")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def load_prompts(args) -> list[str]:
    if args.dataset is None and args.text_file is None:
        return assets.britannica_prompts(args.num_prompts, args.min_words, args.max_words, seed=args.seed)
    ds = assets.load_text_dataset(args.dataset, args.config, split=args.split, column=args.column,
                                  text_file=args.text_file)
    prompts = []
    for text in ds[args.column]:
        if isinstance(text, str) and text.strip():
            prompts.append(text.strip())
            if len(prompts) == args.num_prompts:
                break
    return prompts


def summary_path(out: Path) -> Path:
    return out.with_name(out.stem + ".summary.json")


def main(argv=None) -> int:
    args = parse_args(argv)
    state = make_state(cpu=True if args.cpu else None)
    if args.threads:
        torch.set_num_threads(args.threads)
    elif "OMP_NUM_THREADS" not in os.environ and state.device.type == "cpu":
        torch.set_num_threads(max(1, idle_cores() // state.num_processes))
    with state.main_process_first():  # the first process converts / downloads, the others read the cache
        prompts = load_prompts(args)
        model, tokenizer = assets.load_model_and_tokenizer(args.model, dtype=assets.DTYPES[args.dtype],
                                                           device=state.device,
                                                           attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
    gen = {}
    if args.do_sample:
        gen["do_sample"] = True
        if args.temperature is not None:
            gen["temperature"] = args.temperature
        if args.top_p is not None:
            gen["top_p"] = args.top_p
        if args.top_k is not None:
            gen["top_k"] = args.top_k
    result = generate_distributed(model, tokenizer, prompts, max_batch_tokens=args.max_batch_tokens,
                                  max_new_tokens=args.max_new_tokens, page_size=args.page_size,
                                  max_pages=args.max_pages, state=state, progress=not args.no_progress,
                                  seed=args.seed, prefix_store=args.prefix_store, **gen)
    if state.is_main_process:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for r in result.results:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        summary = dict(model=args.model, dtype=args.dtype, **result.summary)
        summary_path(out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(format_summary(summary))
        print(f"wrote {out} ({len(result.results)} lines) and {summary_path(out)}")
    state.wait_for_everyone()
    if state.use_distributed:
        state.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
