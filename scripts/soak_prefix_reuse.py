#!/usr/bin/env python
"""Soak: a bound, unbounded `PagedCache` reused ``--calls`` times (``cache.reset()``, then ``model.generate``) with a
shared system prompt and a new question each call; prints the page pool and the process RSS as it goes.

Issue 30, item 4: the pool grew on every reuse (300 calls: pages_total 4 -> 571, RSS 1.0 -> 1.8 GB, while at most 4
pages were in use), because new pages were grown instead of reusing cached ones. Both must stay flat: pages_total
within one growth step of the most pages in use, RSS within noise of its value after the first calls.

    python scripts/soak_prefix_reuse.py                   # SmolLM2 (embedded), 300 calls
    python scripts/soak_prefix_reuse.py --model tiny      # a random-weight tiny Llama (seconds)

Outputs: a line every ``--every`` calls and a summary on stdout; soak.md / .json / .png (pages and RSS per call)
in ``--out``. The study is `hf_paged.evaluation.soak`.
"""

from __future__ import annotations

import argparse

from hf_paged.evaluation import soak as study


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=300, help="reset + generate calls (default 300)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny' (random weights) or a local path")
    p.add_argument("--system-tokens", type=int, default=40, help="tokens of the shared system prompt (default 40)")
    p.add_argument("--question-tokens", type=int, default=5, help="tokens of each call's own question (default 5)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per call (default 8)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--every", type=int, default=25, help="print a line every N calls (default 25)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0: torch's choice)")
    p.add_argument("--out", default="runs/soak", help="output folder (default runs/soak)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if min(args.calls, args.system_tokens, args.question_tokens, args.new_tokens, args.page_size, args.every) < 1:
        p.error("--calls, --system-tokens, --question-tokens, --new-tokens, --page-size and --every must be positive")
    return args


if __name__ == "__main__":
    study.main(parse_args())
