#!/usr/bin/env python
"""Quantized pages (issue 32): what each page format costs in perplexity and bytes, and its decode speed.

Part ``perplexity``: the embedded SmolLM2 (float32, "sdpa") scores the first ``--max-tokens`` tokens of the
embedded Britannica text in one forward through a `SimulatedPages` cache, a DynamicCache that keeps each
layer's keys and values as a page scheme would hand them back (quantized, then dequantized, by the
functions of `hf_paged.kv_formats`). int8 quantizes every token on its own when it is
written, so one forward scores exactly what decoding would; int4's keys are per channel within a page: one
forward quantizes every full page as decoding would once it fills, and the last partial page over the tokens
it holds. Rows: float32 (the reference), bfloat16, the formats "int8" and "int4", int4 with its first page (the
attention sinks) kept in float32, bfloat16 or int8 (bytes counted over the text's tokens) or with values in groups
of 32, and the int4 alternatives the choice was made among (keys per token: not rotated, groups of 32 or one a
head, values not rotated; and KIVI's keys per channel within each page of ``--page-size`` tokens, the partial last
page kept in float32: in one forward every full page is quantized, which decoding would do only once the page
fills). Per row: perplexity relative to float32 with a 95% paired bootstrap interval over blocks of ``--block``
tokens (`hf_paged.evaluation.intervals`), the mean KL divergence from float32's next-token distribution (a
steadier measure of the damage than one text's perplexity), top-1 agreement, and KV bytes per token of the whole
model, scales included, against float32.

Part ``speed``: the C kernel's decode call on one SmolLM2-shaped layer (9 query heads, 3 KV heads, head dim
64, pages of ``--page-size``) over each ``--contexts`` length and ``--batches`` size, with float32, bfloat16,
int8 and int4 pages holding the same random keys and values, and a two-tier layer ("float32+int4": float32 pages,
7 of 8 demoted to int4, as a ``cold_format="int4"`` cache holds them at a quarter of the context's bytes). Every
round times each format once (the order rotated round by round), ``--calls`` kernel calls each, in CPU seconds
(``time.process_time``) and wall time; the table gives medians over ``--repeats`` rounds and each format's
per-round ratio to float32 (median and quartiles), with the load average before and after.

Part ``cache``: the real caches with each format the CPU reads (float, int8, int4, int2) on the embedded SmolLM2
(float32, "hf_paged"), with transformers' ``QuantizedCache`` (optimum-quanto backend, ``--peer-bits`` 4 and 2, its
default residual of 128 float tokens) beside them: KV bytes per token from ``PagedCache.stats()["kv_bytes"]`` after a
prefill (float pages of a float32 and of a bfloat16 model, int8, int4, int2; scales included; QuantizedCache: its
quantized history, and with its residual full); perplexity at each ``--cache-tokens`` length against float32 pages with
paired intervals: the formats in one forward through their pages, bfloat16 keys and values (simulated), QuantizedCache
with the text in chunks of its residual length (each token sees what it would see when decoded), and int4 cold pages
(``PagedCache(cold_format="int4")`` without a budget: every full page but the sinks re-quantized to int4, the sinks and
the newest page read in float) with the text in chunks of a page, paired with QuantizedCache int4 too.

Part ``agreement``: greedy agreement with float pages over the many-prompts workload (``--num-prompts`` prompts of
32-256 tokens, 8 or 64 new tokens each): ``generate_many`` with float32 pages, ``kv_format`` "int8" and "int4" pages
and ``cold_format`` "int8" and "int4" (every full page but the sinks demoted once filled); per prompt the new tokens
before the first difference (median, min, prompts equal), per entry the run's peak ``kv_bytes`` and CPU seconds per
run (medians over ``--repeats`` rounds, entries alternating, and the per-round ratio to float32 pages).

Part ``decode``: ``generate``'s decode speed at each ``--decode-contexts`` length and ``--decode-batches`` size,
float32, int8 and int4 pages, int4 cold pages and the QuantizedCache rows holding the same keys and values (computed
once per length; a batch's rows made distinct): each round decodes ``--decode-tokens`` tokens from a fork of each
cache, entries alternating (CPU time per token, medians and quartiles of per-round ratios against float32 pages over
``--repeats`` rounds).

Part ``mixed``: ``generate``'s decode speed at each ``--decode-contexts`` length and ``--decode-batches`` size of a
mixed-precision cache (``PagedCache(page_size=1, max_pages=B, cold_format="int4")``: hot float32 and cold int4 pages
read in place by the C kernel; and the same cache read through the torch path's gathers) against float32 pages
holding the whole prompt and the plain bounded cache of the same bytes (B: the float32 bytes of ``--mixed-budget``
of the batch's tokens, per layer), entries alternating (CPU time per token, medians and quartiles of per-round
ratios against float32 pages over ``--repeats`` rounds).

Without optimum-quanto (the ``eval`` extra) the QuantizedCache rows are skipped with the reason printed and recorded.

Writes ``--out`` (default runs/quantized, git-ignored)/quantized.md, quantized.json and quantized.png. The
study is `hf_paged.evaluation.quantized`.

Examples:
    python scripts/quantized.py                          # every part (hours on 1 core: 8k and 16k tokens)
    python scripts/quantized.py --parts cache --out results/quantized/cache
    python scripts/quantized.py --parts agreement --repeats 3 --out results/quantized/agreement
    python scripts/quantized.py --parts decode --decode-contexts 1024,4096 --repeats 5 --out results/quantized/decode
    python scripts/quantized.py --parts speed --contexts 4096 --batches 1
    python scripts/quantized.py --parts mixed --decode-contexts 1024,4096 --decode-batches 1 --out runs/mixed
    python scripts/quantized.py --quick                  # smoke test, not a result
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_paged import assets  # noqa: E402
from hf_paged.evaluation import quantized as study  # noqa: E402
from hf_paged.evaluation.formats import int_list  # noqa: E402
from hf_paged.evaluation.quantized import DEFAULTS, PARTS, QUICK  # noqa: E402

LISTS = ("contexts", "batches", "cache_tokens", "decode_contexts", "decode_batches", "peer_bits")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"perplexity: tokens of the text (default {DEFAULTS['max_tokens']}, "
                        f"--quick {QUICK['max_tokens']})")
    p.add_argument("--page-size", type=int, default=16,
                   help="pages of KIVI's keys (perplexity) and of the kernel (speed)")
    p.add_argument("--block", type=int, default=64, help="perplexity: tokens per block of the paired bootstrap")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"speed: tokens per row (default {DEFAULTS['contexts']})")
    p.add_argument("--batches", type=int_list, default=None,
                   help=f"speed: rows per call (default {DEFAULTS['batches']})")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"speed, agreement, decode: rounds (default {DEFAULTS['repeats']})")
    p.add_argument("--calls", type=int, default=None, help=f"speed: kernel calls per format and round "
                                                           f"(default {DEFAULTS['calls']})")
    p.add_argument("--cache-tokens", type=int_list, default=None,
                   help=f"cache: perplexity lengths through the real caches (default {DEFAULTS['cache_tokens']})")
    p.add_argument("--decode-contexts", type=int_list, default=None,
                   help=f"decode: prompt lengths of generate's decode speed (default {DEFAULTS['decode_contexts']})")
    p.add_argument("--decode-batches", type=int_list, default=None,
                   help=f"decode: rows per generate (default {DEFAULTS['decode_batches']})")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help=f"decode: new tokens per timed generate (default {DEFAULTS['decode_tokens']})")
    p.add_argument("--peer-bits", type=int_list, default=None,
                   help=f"cache, decode: bit widths of transformers' QuantizedCache rows, of 4 and 2 (default "
                        f"{DEFAULTS['peer_bits']})")
    p.add_argument("--peer-residual", type=int, default=None,
                   help=f"cache, decode: QuantizedCache's residual_length, the newest tokens it keeps in float "
                        f"(default {DEFAULTS['peer_residual']}, transformers' own)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"agreement: prompts of the many-prompts workload (default {DEFAULTS['num_prompts']})")
    p.add_argument("--mixed-budget", type=float, default=None,
                   help=f"mixed: the bounded caches' bytes, as a share of the batch's float32 bytes (default "
                   f"{DEFAULTS['mixed_budget']})")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the kernel's); 1 measures CPU time cleanly")
    p.add_argument("--quick", action="store_true", help="smoke test (seconds to a minute, not a result)")
    p.add_argument("--out", default="runs/quantized", help="output folder (git-ignored runs/)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, int_list(value) if key in LISTS else value)
    args.parts = [part.strip() for part in args.parts.split(",") if part.strip()]
    if not args.parts or set(args.parts) - set(PARTS):
        p.error(f"--parts takes a comma-separated list of {', '.join(PARTS)}, got {','.join(args.parts)!r}")
    if set(args.peer_bits) - {4, 2}:
        p.error(f"--peer-bits takes 4 and/or 2 (quanto's widths), got {args.peer_bits}")
    for name in ("max_tokens", "page_size", "block", "repeats", "calls", "threads", "decode_tokens",
                 "peer_residual"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not 0 < args.mixed_budget < 1:
        p.error(f"--mixed-budget is a share of the context's bytes, between 0 and 1, got {args.mixed_budget}")
    if args.num_prompts <= 0:
        p.error("--num-prompts must be positive")
    return args


if __name__ == "__main__":
    sys.exit(study.main(parse_args()))
