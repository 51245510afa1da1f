#!/usr/bin/env python
"""KV memory of page sharing: `hf_paged.PagedCache` + "hf_paged" attention vs `DynamicCache` + "sdpa".

One run on the embedded SmolLM2-135M (``hf_paged.assets``) with a prompt cut from the Britannica
article (``--prompt-tokens`` tokens, default 1024), three scenarios side by side:

(a) beam search, 4 beams: generate expands the prompt to 4 rows before prefill; DynamicCache
    stores 4 copies of it, PagedCache stores it once (rows of a fresh batch that hold identical
    keys share pages) and beam reorders share pages (copy-on-write of a partly filled page).
(b) 8 sampled returns (``do_sample=True, num_return_sequences=8``): the same, 8 rows per prompt.
(c) fork of a prompt cache (the transformers docs pattern "compute a prompt cache once, deep-copy
    it per question"): the extra KV bytes right after ``cache.fork()`` / ``copy.deepcopy`` and
    after one new token per row, with ``--fork-rows`` prompts in the batch.

KV bytes: DynamicCache = nbytes of every layer's keys and values; PagedCache = ``stats()["kv_bytes"]``
(used + cached pages; no model is bound here, so nothing is cached). "peak" is sampled after every
forward step by a LogitsProcessor that reads the cache passed to generate; "end" is after generate
returns. The allocated page pool (``stats()["pool_bytes"]``, which grows geometrically) is reported
alongside. Targets: (a) paged / dynamic <= 0.35, (b) <= 0.2, (c) extra bytes <= one page per row.
Both caches must produce the same tokens (sampling: same seed), and the fork's logits must match
the deep-copied DynamicCache's.

Outputs: a markdown table on stdout; with ``--out DIR`` also DIR/sharing.md and DIR/sharing.json. The study is
`hf_paged.evaluation.sharing`; docs/sharing.md has the stored result and its command.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from hf_paged.evaluation import sharing as study  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="sharing_memory.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length in tokens (default 1024)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per row (default 32)")
    p.add_argument("--page-size", type=int, default=16, help="PagedCache page size (default 16)")
    p.add_argument("--beams", type=int, default=4, help="beams of scenario (a) (default 4)")
    p.add_argument("--samples", type=int, default=8, help="sampled returns of scenario (b) (default 8)")
    p.add_argument("--fork-rows", type=int, default=2, help="prompts in the batch of scenario (c) (default 2)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default, embedded) or a local path")
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads (default 1; 0 = torch's choice). Memory does not depend on it; on "
                        "a busy 2-core machine two threads were 5-25x slower than one")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (the same for both caches)")
    p.add_argument("--out", default=None, help="folder for sharing.md and sharing.json (default: print only)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("--threads must be >= 0")
    for name in ("prompt_tokens", "new_tokens", "page_size", "beams", "samples", "fork_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


if __name__ == "__main__":
    argv = sys.argv[1:]
    study.main(parse_args(argv), argv)
