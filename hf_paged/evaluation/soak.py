"""A bound, unbounded `PagedCache` reused many times (``reset()``, then ``model.generate``) with a shared system
prompt and a new question each call: the page pool and the process RSS per call (the study behind
scripts/soak_prefix_reuse.py, whose docstring says what it checks).

Both must stay flat: ``pages_total`` within one growth step of the most pages in use at once, RSS within noise of
its value after the first calls (issue 30, item 4: the pool grew on every reuse).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_paged

from .. import assets
from .formats import pyplot, write_report
from .memory import _proc_status_kib
from .run_info import load_average


def load(name: str):
    """(model with "hf_paged" attention, vocabulary size): ``"tiny"`` is a random-weight three-layer Llama."""
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
    """One row per call: pages (total, used, cached), prefix hits so far, RSS."""
    model, vocab = load(args.model)
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (args.system_tokens,), generator=g).tolist()
    cache = hf_paged.PagedCache(page_size=args.page_size, model=model)
    rows = []
    for call in tqdm(range(args.calls), desc="soak", unit="call", disable=args.no_progress):
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
    settled = rows[min(9, len(rows) - 1)]
    summary = dict(calls=args.calls, model=args.model, peak_pages_used=max(r["pages_used"] for r in rows),
                   pages_total_first=rows[0]["pages_total"], pages_total_last=rows[-1]["pages_total"],
                   pages_total_max=max(r["pages_total"] for r in rows), rss_mib_after_10=settled["rss_mib"],
                   rss_mib_last=rows[-1]["rss_mib"], rss_growth_mib_after_10=rows[-1]["rss_mib"] - settled["rss_mib"],
                   threads=torch.get_num_threads(), load_average=load_average())
    return dict(settings=vars(args), summary=summary, rows=rows)


def markdown(result: dict) -> str:
    s = result["summary"]
    return (f"PagedCache(model=...) reused {s['calls']} times ({s['model']}): pages_total {s['pages_total_first']} -> "
            f"{s['pages_total_last']} (max {s['pages_total_max']}, peak in use {s['peak_pages_used']}); RSS "
            f"{s['rss_mib_after_10']:.1f} MiB after 10 calls -> {s['rss_mib_last']:.1f} MiB "
            f"({s['rss_growth_mib_after_10']:+.1f}); {s['threads']} thread(s), load average {s['load_average']}\n")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
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
    fig.suptitle(markdown(result), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> dict:
    """Run the soak of ``args`` (scripts/soak_prefix_reuse.py's arguments) and write soak.md / .json / .png."""
    if args.threads:
        torch.set_num_threads(args.threads)
    result = soak(args)
    text = markdown(result)
    write_report(Path(args.out), "soak", text, result, lambda path: plot(result, path))
    print(text)
    return result
