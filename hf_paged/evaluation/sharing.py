"""KV memory of page sharing: `hf_paged.PagedCache` + "hf_paged" attention against `DynamicCache` + "sdpa" (the
study behind scripts/sharing_memory.py, whose docstring describes the three scenarios and the flags).

KV bytes: DynamicCache = nbytes of every layer's keys and values; PagedCache = ``stats()["kv_bytes"]`` (used +
cached pages; no model is bound, so nothing is cached). "peak" is sampled after every forward step by a
LogitsProcessor (`Probe`); "end" after generate returns; the allocated pool is reported alongside. Targets: beams
paged / dynamic <= 0.35, samples <= 0.2, a fork's extra bytes <= one page per row. Both caches must produce the
same tokens (sampling: same seed), and the fork's logits must match the deep-copied DynamicCache's.
"""

from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

from .. import assets
from .caches import ATTN, cache_rows, kv_bytes, make_cache, use_attention
from .formats import mib, write_report
from .run_info import load_average, versions

TARGETS = {"beam": 0.35, "sample": 0.2}


class Probe:
    """LogitsProcessor (duck-typed): samples the cache's memory after every forward step."""

    def __init__(self, cache, bar=None):
        self.cache, self.bar = cache, bar
        self.peak = self.pool_peak = 0
        self.steps = 0

    def __call__(self, input_ids, scores):
        held, pool = kv_bytes(self.cache)
        self.peak, self.pool_peak = max(self.peak, held), max(self.pool_peak, pool)
        self.steps += 1
        if self.bar is not None:
            self.bar.update()
        return scores


def run_generate(model, kind, inputs, gen: dict, args, tqdm, label: str) -> dict:
    import torch
    from transformers import LogitsProcessorList

    use_attention(model, kind)
    cache = make_cache(kind, model, args.page_size)
    with tqdm(total=args.new_tokens, desc=f"{label} {kind}", disable=args.no_progress, leave=False,
              file=sys.stderr) as bar:
        probe = Probe(cache, bar)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        out = model.generate(**inputs, **gen, cache=cache, logits_processor=LogitsProcessorList([probe]))
        wall = time.perf_counter() - start
    end, pool_end = kv_bytes(cache)
    result = dict(kv_bytes_end=end, kv_bytes_peak=max(probe.peak, end), pool_bytes_end=pool_end,
                  pool_bytes_peak=max(probe.pool_peak, pool_end), steps=probe.steps, wall_s=wall,
                  rows=cache_rows(cache), sequences_returned=out.shape[0])
    if kind == "paged":
        result["stats"] = cache.stats()
    return result, out


def scenario_generate(model, inputs, gen, args, tqdm, label) -> dict:
    import torch

    runs, seqs = {}, {}
    for kind in ATTN:
        runs[kind], seqs[kind] = run_generate(model, kind, inputs, gen, args, tqdm, label)
    d, p = runs["dynamic"], runs["paged"]
    return dict(dynamic=d, paged=p, tokens_match=bool(torch.equal(seqs["dynamic"], seqs["paged"])),
                ratio_end=p["kv_bytes_end"] / d["kv_bytes_end"], ratio_peak=p["kv_bytes_peak"] / d["kv_bytes_peak"])


def scenario_fork(model, inputs, args) -> dict:
    """Extra KV bytes of a second cache continuing the same prompt cache: fork() vs deepcopy."""
    import torch

    rows = inputs["input_ids"].shape[0]
    step = torch.full((rows, 1), int(inputs["input_ids"][0, -1]), dtype=torch.long)
    mask = torch.cat([inputs["attention_mask"], torch.ones(rows, 1, dtype=torch.long)], 1)
    out, logits = {}, {}
    for kind in ATTN:
        use_attention(model, kind)
        cache = make_cache(kind, model, args.page_size)
        with torch.no_grad():
            model(**inputs, cache=cache)
        base = kv_bytes(cache)[0]
        if kind == "paged":
            out["page_bytes"] = base // cache.stats()["pages_used"]  # one page in every layer, K and V
        twin = cache.fork() if kind == "paged" else copy.deepcopy(cache)
        after_fork = kv_bytes(cache)[0] + (0 if kind == "paged" else kv_bytes(twin)[0])
        with torch.no_grad():
            logits[kind] = model(input_ids=step, attention_mask=mask, cache=twin).logits
        after_step = kv_bytes(cache)[0] + (0 if kind == "paged" else kv_bytes(twin)[0])
        out[kind] = dict(prompt_kv_bytes=base, extra_after_fork=after_fork - base, extra_after_token=after_step - base)
        if kind == "paged":
            out[kind]["stats"] = cache.stats()
        del twin, cache
    out["rows"] = rows
    out["logits_match"] = bool(torch.allclose(logits["paged"], logits["dynamic"], atol=1e-4, rtol=1e-4))
    out["target_bytes"] = rows * out["page_bytes"]
    return out


def markdown_table(result: dict) -> str:
    s = result["settings"]
    head = ("| scenario | cache rows | DynamicCache KV MiB | PagedCache KV MiB | paged / dynamic | target "
            "| meets target | paged pool MiB (allocated) | tokens match |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, title in (("beam", f"(a) beam search, {s['beams']} beams"),
                       ("sample", f"(b) {s['samples']} sampled returns")):
        r = result[key]
        d, p = r["dynamic"], r["paged"]
        for when in ("end", "peak"):
            ratio = r[f"ratio_{when}"]
            lines.append(
                f"| {title}, {when} | {p['rows']} | {mib(d[f'kv_bytes_{when}'], 2)} | {mib(p[f'kv_bytes_{when}'], 2)} "
                f"| {ratio:.3f} | <= {TARGETS[key]} | {'yes' if ratio <= TARGETS[key] else 'NO'} "
                f"| {mib(p[f'pool_bytes_{when}'], 2)} | {'yes' if r['tokens_match'] else 'NO'} |")
    f = result["fork"]
    target = f["target_bytes"]
    for when, title in (("extra_after_fork", "right after the fork"),
                        ("extra_after_token", "after 1 new token per row")):
        d, p = f["dynamic"][when], f["paged"][when]
        ratio = p / d if d else float("nan")
        lines.append(
            f"| (c) fork of a {s['prompt_tokens']}-token prompt cache: extra KV {title} | {f['rows']} | {mib(d, 2)} "
            f"(deepcopy) | {mib(p, 2)} (fork) | {ratio:.4f} | <= {f['rows']} page(s) = {target / 2**10:.0f} KiB "
            f"| {'yes' if p <= target else 'NO'} | - | {'yes' if f['logits_match'] else 'NO'} (logits) |")
    return "\n".join(lines)


def markdown_report(result: dict) -> str:
    s, e = result["settings"], result["environment"]
    return "\n".join([
        "# hf_paged page sharing: KV memory, PagedCache + hf_paged vs DynamicCache + sdpa",
        "",
        f"model `{s['model']}` ({e['model_class']}, {e['num_layers']} layers, {e['kv_heads']} KV heads x "
        f"{e['head_dim']}), float32, {s['prompt_tokens']}-token prompt(s) from the Britannica article, "
        f"{s['new_tokens']} new tokens, page size {s['page_size']}, torch threads {e['torch_threads']}.",
        f"torch {e['torch']}, transformers {e['transformers']}, hf_paged {e['hf_paged']}, python {e['python']}, "
        f"{e['platform']}. Wall time {result['wall_s']:.0f} s.",
        "",
        markdown_table(result),
        "",
        "KV: DynamicCache = nbytes of every layer's keys + values; PagedCache = stats()['kv_bytes'] (pages in use, "
        "every layer). cache rows: (a) 1 prompt x beams, (b) 1 prompt x returned sequences, (c) prompts. "
        "end = after generate returns; peak = max over forward steps (sampled by a LogitsProcessor; DynamicCache's "
        "transient copies inside torch.cat are not seen). "
        "pool = pages allocated (the pool grows geometrically; freed pages are reused). (c): extra bytes of the "
        "second cache (fork() vs copy.deepcopy of a DynamicCache), and after one new token per row in it; "
        "one page = page_size tokens x every layer's K and V.",
        "",
    ])


def main(args, argv: list[str]) -> dict:
    """Run the three scenarios of ``args`` (scripts/sharing_memory.py's arguments, ``argv`` as given, recorded);
    print the report and, with ``args.out``, write it."""
    wall_start = time.perf_counter()

    import torch
    import transformers
    from tqdm.auto import tqdm

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_model_and_tokenizer(args.model, attn_implementation="sdpa")
    text = tokenizer(assets.britannica_text(), add_special_tokens=False)["input_ids"]
    P = args.prompt_tokens
    rows = max(1, args.fork_rows)
    if len(text) < rows * P:
        raise SystemExit(f"the article has {len(text)} tokens, fewer than {rows} x {P}")
    prompts = torch.tensor([text[i * P:(i + 1) * P] for i in range(rows)])
    one = {"input_ids": prompts[:1], "attention_mask": torch.ones_like(prompts[:1])}
    batch = {"input_ids": prompts, "attention_mask": torch.ones_like(prompts)}
    pad = tokenizer.pad_token_id
    text_cfg = model.config.get_text_config(decoder=True)
    environment = dict(
        **versions(("torch", "transformers", "hf_paged")), torch_threads=torch.get_num_threads(),
        cpu_count=os.cpu_count(), model_class=type(model).__name__, num_layers=text_cfg.num_hidden_layers,
        kv_heads=text_cfg.num_key_value_heads, head_dim=getattr(text_cfg, "head_dim", None)
        or text_cfg.hidden_size // text_cfg.num_attention_heads,
        load_avg_start=load_average())
    settings = dict(model=args.model, prompt_tokens=P, new_tokens=args.new_tokens, page_size=args.page_size,
                    beams=args.beams, samples=args.samples, fork_rows=rows, seed=args.seed, targets=TARGETS,
                    argv=list(argv))
    common = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, pad_token_id=pad)
    result = dict(settings=settings, environment=environment)
    with tqdm(total=3, desc="scenarios", disable=args.no_progress, file=sys.stderr) as bar:
        bar.set_postfix_str("beam search")
        result["beam"] = scenario_generate(
            model, one, dict(common, do_sample=False, num_beams=args.beams, num_return_sequences=1,
                             early_stopping=False), args, tqdm, f"beam{args.beams}")
        bar.update()
        bar.set_postfix_str("sampling")
        result["sample"] = scenario_generate(
            model, one, dict(common, do_sample=True, num_return_sequences=args.samples, temperature=1.0, top_k=50),
            args, tqdm, f"sample{args.samples}")
        bar.update()
        bar.set_postfix_str("fork")
        result["fork"] = scenario_fork(model, batch, args)
        bar.update()
    environment["load_avg_end"] = load_average()
    result["wall_s"] = time.perf_counter() - wall_start
    report = markdown_report(result)
    print(report)
    if args.out:
        out = Path(args.out)
        write_report(out, "sharing", report, result, indent=1, strict=False)
        print(f"wrote {out / 'sharing.md'}, {out / 'sharing.json'}", file=sys.stderr)
    return result

