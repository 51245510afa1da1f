#!/usr/bin/env python
"""Soak: a bound, unbounded `PagedCache` reused ``--calls`` times (``cache.reset()``, then ``model.generate``) with a
shared system prompt and a new question each call; prints the page pool and the process RSS as it goes.

Issue 30, item 4: the pool grew on every reuse (300 calls: pages_total 4 -> 571, RSS 1.0 -> 1.8 GB, while at most 4
pages were in use), because new pages were grown instead of reusing cached ones. Both must stay flat: pages_total
within one growth step of the most pages in use, RSS within noise of its value after the first calls.

    python scripts/soak_prefix_reuse.py                   # SmolLM2 (embedded), 300 calls
    python scripts/soak_prefix_reuse.py --model tiny      # a random-weight tiny Llama (seconds)

Outputs: a line every ``--every`` calls and a summary on stdout; DIR/soak.json and DIR/soak.png (pages and RSS
per call) in ``--out`` (default runs/soak-<time>).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import assets  # noqa: E402
from benchmark import _proc_status_kib  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak_prefix_reuse.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300, help="reset + generate calls (default 300)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default), 'tiny' (random weights) or a local path")
    p.add_argument("--system-tokens", type=int, default=40, help="tokens of the shared system prompt (default 40)")
    p.add_argument("--question-tokens", type=int, default=5, help="tokens of each call's own question (default 5)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated per call (default 8)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--every", type=int, default=25, help="print a line every N calls (default 25)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0: torch's choice)")
    p.add_argument("--out", default=None, help="output folder (default runs/soak-<time>)")
    args = p.parse_args(argv)
    if min(args.calls, args.system_tokens, args.question_tokens, args.new_tokens, args.page_size, args.every) < 1:
        p.error("--calls, --system-tokens, --question-tokens, --new-tokens, --page-size and --every must be positive")
    return args


def load(name: str):
    """(model with "hf_paged" attention, vocabulary size)."""
    if name != "tiny":
        model, tokenizer = assets.load_model_and_tokenizer(name, attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
        return model, len(tokenizer)
    import transformers

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
    return model.eval(), config.vocab_size


def soak(args) -> dict:
    model, vocab = load(args.model)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (args.system_tokens,), generator=g).tolist()
    cache = hf_paged.PagedCache(page_size=args.page_size, model=model)
    rows = []
    for call in tqdm(range(args.calls), desc="soak", unit="call"):
        cache.reset()
        prompt = torch.tensor([system + torch.randint(3, vocab, (args.question_tokens,), generator=g).tolist()])
        with torch.no_grad():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                           do_sample=False, pad_token_id=0, cache=cache)
        stats = cache.stats()
        rows.append(dict(call=call + 1, pages_total=stats["pages_total"], pages_used=stats["pages_used"],
                         pages_cached=stats["pages_cached"], prefix_hits=stats["prefix_hits"],
                         rss_mib=(_proc_status_kib("VmRSS") or 0) / 1024))
        if (call + 1) % args.every == 0 or call == 0:
            r = rows[-1]
            tqdm.write(f"call {r['call']:4d}: pages_total {r['pages_total']:4d}, used {r['pages_used']:3d}, cached "
                       f"{r['pages_cached']:4d}, prefix hits {r['prefix_hits']:5d}, RSS {r['rss_mib']:7.1f} MiB")
    peak_used = max(r["pages_used"] for r in rows)
    settled = rows[min(9, len(rows) - 1)]
    summary = dict(calls=args.calls, model=args.model, peak_pages_used=peak_used,
                   pages_total_first=rows[0]["pages_total"], pages_total_last=rows[-1]["pages_total"],
                   pages_total_max=max(r["pages_total"] for r in rows),
                   rss_mib_after_10=settled["rss_mib"], rss_mib_last=rows[-1]["rss_mib"],
                   rss_growth_mib_after_10=rows[-1]["rss_mib"] - settled["rss_mib"],
                   load_average=list(os.getloadavg()))
    return dict(args=vars(args), summary=summary, rows=rows)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    calls = [r["call"] for r in rows]
    fig, (pages, rss) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    for key in ("pages_total", "pages_used", "pages_cached"):
        pages.plot(calls, [r[key] for r in rows], label=key)
    pages.set_ylabel("pages")
    pages.legend()
    rss.plot(calls, [r["rss_mib"] for r in rows])
    rss.set_ylabel("RSS (MiB)")
    rss.set_xlabel("call (reset + generate)")
    fig.suptitle(f"PagedCache(model=...) reused {result['summary']['calls']} times ({result['summary']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else ROOT / "runs" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    result = soak(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=2))
    try:
        plot(result, out / "soak.png")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install '.[eval]')", file=sys.stderr)
    s = result["summary"]
    print(f"{s['calls']} calls: pages_total {s['pages_total_first']} -> {s['pages_total_last']} (max "
          f"{s['pages_total_max']}, peak in use {s['peak_pages_used']}); RSS {s['rss_mib_after_10']:.1f} MiB after 10 "
          f"calls -> {s['rss_mib_last']:.1f} MiB ({s['rss_growth_mib_after_10']:+.1f}); load average "
          f"{s['load_average']}; {out}")
    return result


if __name__ == "__main__":
    main()
