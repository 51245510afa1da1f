#!/usr/bin/env python
"""Many prompts of different lengths: `generate_many` against `generate` and transformers' continuous batching.

Workload (as a user serving many requests would have it): ``--num-prompts`` Britannica prompts whose
lengths are spread evenly over ``--min-len``..``--max-len`` tokens (shuffled, one seed), half of them
wanting ``--short-new`` new tokens and half ``--long-new``, greedy, on the embedded SmolLM2; with
``--system-prompt N`` the same N-token passage is put in front of every prompt. Systems, run
alternately (order rotated every repeat), medians over ``--repeats``:

* ``dynamic``: ``model.generate`` + DynamicCache (sdpa), the prompts in batches of ``--batch-size`` (left
  padded, each batch generating its longest request's tokens);
* ``paged``: the same with a `PagedCache`;
* ``transformers CB``: transformers' continuous batching manager, one request per prompt with its own
  ``max_new_tokens``, ``max_batch_tokens=--cb-max-batch-tokens`` and its pool sized to the workload (its
  default block size, enough blocks for every request at once);
* ``generate_many``: `hf_paged.generate_many` (``--max-batch-tokens`` per step);
* ``generate_many packed``: the same on a copy of the model whose linear weights are packed once
  (`hf_paged.pack_linear_weights`);
* ``generate_many compiled`` (``--compile``): `generate_many(compile=True)` (`hf_paged.compile_many_steps`: inductor,
  weights frozen and packed, q/k/v and gate/up merged, elementwise work fused) on its own copy of the model, after
  an untimed pass that compiles it; ``--compile-batch-tokens 256,1024,4096`` runs it once per step budget, a row
  each (``generate_many compiled (1024)``; the graphs take any step size: one compile serves them all);
* ``vLLM CPU`` (``--vllm``; when ``.venv-vllm`` exists, made by ``scripts/make_vllm_env.sh``): vLLM's engine on
  the same token ids and weights (float32, greedy, the same threads, its default steps) in its own process
  (scripts/vllm_runner.py); otherwise its row reads "not run".

``--systems`` runs a subset (the first named is the reference). Reported: tokens/s over wanted tokens (and the
ratio to ``dynamic``), CPU-seconds per pass, mean time to first
token over prompts, peak RSS growth (`hf_paged.evaluation.memory.MemoryMeter`), prefix pages reused, and whether every
prompt's tokens equal the ``dynamic`` run's. Spread = (max - min) / median of a system's repeats; over 20%
marks a noisy row. Outputs: many_prompts.md / .json / .png in ``--out``. The study is
`hf_paged.evaluation.many_prompts`; docs/many_prompts.md has the stored results and their commands.
"""

from __future__ import annotations

import argparse

from hf_paged.evaluation import many_prompts as study
from hf_paged.evaluation.formats import int_list
from hf_paged.kv_formats import KV_FORMATS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--short-new", type=int, default=8)
    p.add_argument("--long-new", type=int, default=64)
    p.add_argument("--system-prompt", type=int, default=0, help="tokens of a shared passage before every prompt")
    p.add_argument("--batch-size", type=int, default=8, help="generate's batch size (dynamic, paged)")
    p.add_argument("--max-batch-tokens", type=int, default=256, help="generate_many's tokens per step")
    p.add_argument("--kv-format", default="float", choices=KV_FORMATS, help="page format of the PagedCache and "
                   "generate_many's RaggedCache (hf_paged.kv_formats)")
    p.add_argument("--cb-max-batch-tokens", type=int, default=1024, help="transformers CB's tokens per step")
    p.add_argument("--vllm", default=None, help="'auto' (.venv-vllm if present; the default, 'off' with --quick), "
                   "'off', or a python with vllm")
    p.add_argument("--systems", default=",".join(study.SYSTEMS), help="the systems to run, comma separated (the "
                   "first is the reference of 'vs' and 'tokens equal'); vLLM CPU joins them when present")
    p.add_argument("--compile", action="store_true", help="add generate_many(compile=True) (its compile pass untimed)")
    p.add_argument("--compile-batch-tokens", type=int_list, default=None, help="with --compile: the compiled row "
                   "once per step budget, e.g. 256,1024,4096 (default: --max-batch-tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix-store", default=None, help="generate_many's prefix store (a folder, file:///dir or "
                   "redis://host:port/db); from the second repeat on it holds every prompt")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="smoke test: 4 short prompts, 1 repeat")
    p.add_argument("--out", default="runs/many_prompts")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    unknown = sorted(set(args.systems) - set(study.SYSTEMS))
    if unknown or not args.systems:
        p.error(f"--systems: unknown {unknown} (known: {', '.join(study.SYSTEMS)})" if unknown else
                "--systems: name at least one system")
    args.vllm = args.vllm or ("off" if args.quick else "auto")  # a smoke test does not wait for vLLM's compile
    if args.quick:
        args.num_prompts, args.max_len, args.short_new, args.long_new, args.repeats = 4, 48, 4, 8, 1
        args.system_prompt = min(args.system_prompt, 32)
    return args


if __name__ == "__main__":
    study.main(parse_args())
