"""Speed and memory of `hf_paged.PagedCache` + "hf_paged" attention against `DynamicCache` + "sdpa" (the study
behind scripts/benchmark.py, whose docstring and --help describe its configurations and flags).

One model is loaded once; for every configuration the caches run alternately (a short warm-up of each first, then
``repeats`` timed runs, the order flipped every repeat) on prompts cut from the Britannica article at exactly the
context length, one distinct slice per batch row; medians over the repeats. Per ``generate`` run (a LogitsProcessor,
`StepProbe`, is called once per forward step): prefill tokens/s (rows x context / time to the first step), decode
tokens/s (rows x (new tokens - 1) / time from the first to the last step, the probe's own time subtracted), KV
bytes at the end and at their peak (sampled after every step), the page pool, peak memory growth (`MemoryMeter`),
and whether the paged run produced the dynamic run's tokens in every repeat. With a budget, greedy configurations
also get rounds in which the unbounded and the bounded PagedCache decode taking turns token by token
(`alternate_decode_steps`): per-step time ratios that load drifting over seconds does not skew. A speed ratio whose
repeats spread by more than `NOISE` is marked "noisy" beside its value.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import assets
from .caches import ATTN, StudyStore, kv_bytes, make_cache, store_text, use_attention
from .formats import mib, pyplot, write_report
from .memory import MemoryMeter
from .run_info import load_average, source_fingerprint, versions

CACHES = ("dynamic", "paged")  # with --budget also "bounded": a PagedCache held to that many tokens

# Axis values when an axis is not given on the command line.
ALL_CONTEXTS = [256, 1024, 4096]
ALL_BATCH_SIZES = [1, 8]
ALL_MODES = ["greedy", "beam4", "sample8"]
ALL_PAGE_SIZES = [16, 128]
BASE = dict(context=1024, batch=1, mode="greedy", page_size=16)  # for axes left out of a partial grid

# The default covering set: every value of every axis at least once, without the full cross product
# (36 configurations, hours on 2 CPU cores).
DEFAULT_SET = [
    (256, 1, "greedy", 16), (1024, 1, "greedy", 16), (4096, 1, "greedy", 16),
    (256, 8, "greedy", 16), (1024, 8, "greedy", 16),
    (1024, 1, "beam4", 16), (1024, 1, "sample8", 16),
    (4096, 1, "greedy", 128),
]
QUICK_SET = [
    (32, 1, "greedy", 16), (64, 1, "greedy", 16), (32, 2, "greedy", 16),
    (32, 1, "beam4", 16), (32, 1, "sample8", 16), (64, 1, "greedy", 8),
]
QUICK = dict(new_tokens=5, repeats=1, warmup=1)
DEFAULTS = dict(new_tokens=32, repeats=3, warmup=1)

# --------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    context: int
    batch: int
    mode: str
    page_size: int

    @property
    def name(self) -> str:
        return f"ctx{self.context}-b{self.batch}-{self.mode}-p{self.page_size}"


def parse_mode(mode: str) -> dict:
    """'greedy' | 'beamN' | 'sampleN' -> generate kwargs and the row multiplier."""
    if mode == "greedy":
        return dict(kwargs=dict(do_sample=False, num_beams=1), rows_per_prompt=1, deterministic=True)
    m = re.fullmatch(r"(beam|sample)(\d+)", mode)
    if not m or int(m.group(2)) < 1:
        raise ValueError(f"mode {mode!r}: expected greedy, beamN or sampleN (N >= 1)")
    n = int(m.group(2))
    if m.group(1) == "beam":
        return dict(kwargs=dict(do_sample=False, num_beams=n, num_return_sequences=1, early_stopping=False),
                    rows_per_prompt=n, deterministic=True)
    return dict(kwargs=dict(do_sample=True, num_beams=1, num_return_sequences=n, temperature=1.0, top_k=50,
                            top_p=1.0), rows_per_prompt=n, deterministic=False)


def mode_list(text: str) -> list[str]:
    """argparse type: comma-separated modes (`parse_mode`), e.g. "greedy,beam4"."""
    modes = [v.strip() for v in text.split(",") if v.strip()]
    for m in modes:
        try:
            parse_mode(m)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not modes:
        raise argparse.ArgumentTypeError("no mode given")
    return modes


def build_configs(args) -> list[Config]:
    axes = dict(context=args.contexts, batch=args.batch_sizes, mode=args.modes, page_size=args.page_sizes)
    given = {k: v for k, v in axes.items() if v is not None}
    if args.full:
        lists = dict(context=ALL_CONTEXTS, batch=ALL_BATCH_SIZES, mode=ALL_MODES, page_size=ALL_PAGE_SIZES)
        lists.update(given)
    elif given:
        lists = {k: [v] for k, v in BASE.items()}
        lists.update(given)
    else:
        return [Config(*c) for c in (QUICK_SET if args.quick else DEFAULT_SET)]
    keys = ["context", "batch", "mode", "page_size"]
    return [Config(**dict(zip(keys, combo))) for combo in itertools.product(*(lists[k] for k in keys))]


# -------------------------------------------------------------------------------------- caches
def cache_memory(cache) -> dict:
    """KV bytes held and allocated (`kv_bytes`)."""
    held, allocated = kv_bytes(cache)
    return dict(kv_bytes=held, pool_bytes=allocated)


class StepProbe:
    """LogitsProcessor (duck-typed): timestamps every forward step and samples the cache's memory after it.

    generate calls it once per forward step, after the step's logits. Its own sampling time is
    subtracted from the timestamps that follow it.
    """

    def __init__(self, kind: str, cache, sync):
        self.kind, self.cache, self.sync = kind, cache, sync
        self.times: list[float] = []
        self.kv_peak = 0
        self.pool_peak = 0
        self.overhead = 0.0

    def __call__(self, input_ids, scores):
        self.sync()
        now = time.perf_counter()
        self.times.append(now - self.overhead)
        mem = cache_memory(self.cache)
        self.kv_peak = max(self.kv_peak, mem["kv_bytes"])
        self.pool_peak = max(self.pool_peak, mem["pool_bytes"])
        self.overhead += time.perf_counter() - now
        return scores


# ------------------------------------------------------------------------------------- prompts
def prompt_batch(token_ids: list[int], context: int, batch: int, device):
    """``batch`` distinct slices of exactly ``context`` tokens, spread over the text."""
    import torch

    n = len(token_ids)
    if context >= n:
        raise SystemExit(f"context {context} is longer than the text ({n} tokens)")
    span = n - context
    starts = [0] if batch == 1 else [round(b * span / (batch - 1)) for b in range(batch)]
    if len(set(starts)) < batch:
        raise SystemExit(f"cannot cut {batch} distinct prompts of {context} tokens from {n} tokens")
    ids = torch.tensor([token_ids[s:s + context] for s in starts], dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# ----------------------------------------------------------------------------------------- runs
def fresh_cache(model, kind: str, cfg: Config, budget: int | None = None, budget_page_size: int | None = None,
                budget_options: dict | None = None):
    """A new cache of ``kind``: DynamicCache, the unbounded PagedCache ("paged"), or the PagedCache held to
    ``budget`` tokens per row and layer ("bounded": a pool of ``budget // page size`` pages per row the
    configuration decodes; a longer prompt is cut to it after prefill)."""
    options = dict(budget_options or {})
    kv_format = options.pop("kv_format", "float")  # of every PagedCache (a DynamicCache ignores it)
    store = options.pop("store", None)  # every PagedCache's prefix store (a StudyStore)
    if kind != "bounded":
        return make_cache(kind, model, cfg.page_size, store, kv_format=kv_format)
    page_size = budget_page_size or cfg.page_size
    rows = cfg.batch * parse_mode(cfg.mode)["rows_per_prompt"]
    rows = 1 if options.get("per_head_eviction") else rows  # (a per-head cache's max_pages is per row)
    return make_cache("paged", model, page_size, store, max_pages=rows * (budget // page_size), compress_prompt=True,
                      kv_format=kv_format, **options)


def add_store_counters(caches, budget_options: dict | None) -> None:
    """Add the store counters of ``caches`` (PagedCaches) to the totals of the options' prefix store, if any."""
    store = (budget_options or {}).get("store")
    for cache in caches if store is not None else ():
        store.add(cache)


def alternate_decode_steps(model, cfg: Config, inputs, new_tokens: int, sync, kinds: tuple[str, str],
                           budget: int | None = None, budget_page_size: int | None = None,
                           budget_options: dict | None = None) -> dict:
    """One round of greedy decoding with two caches (``kinds``: ("paged", "bounded"), or ("dynamic", "paged") with
    each cache's attention) taking turns token by token.

    Each cache is prefilled with ``inputs``, then decodes ``new_tokens - 1`` steps of its own greedy tokens
    (what ``generate`` decodes), one model step each in turn, the order swapped every step. Every step
    is timed (forward and arg-max) in CPU-seconds on the CPU (`time.process_time`: other processes' load on a shared
    machine does not count), wall seconds on CUDA; load that drifts over seconds hits both caches' steps of a pair
    alike, so their ratios are far tighter than those of whole runs. The model switches attention between the two
    caches' steps, outside the timed part. -> per cache: step times (s) and the new tokens ``[rows, new_tokens]``.
    """
    import inspect

    import torch

    import hf_paged

    caches = {kind: fresh_cache(model, kind, cfg, budget, budget_page_size, budget_options) for kind in kinds}
    ids = inputs["input_ids"]
    rows, context = ids.shape
    last_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    tokens = {kind: [] for kind in kinds}
    times = {kind: [] for kind in kinds}
    clock = time.process_time if ids.device.type == "cpu" else time.perf_counter
    with torch.inference_mode():
        for kind in kinds:
            use_attention(model, kind)
            logits = model(input_ids=ids, use_cache=True, **{hf_paged.CACHE_KWARG: caches[kind]}, **last_only).logits
            tokens[kind].append(logits[:, -1:].argmax(-1))
        for step in range(new_tokens - 1):
            position = torch.full((rows, 1), context + step, dtype=torch.long, device=ids.device)
            for kind in kinds if step % 2 == 0 else kinds[::-1]:
                use_attention(model, kind)
                sync()
                start = clock()
                logits = model(input_ids=tokens[kind][-1], position_ids=position, use_cache=True,
                               **{hf_paged.CACHE_KWARG: caches[kind]}).logits
                tokens[kind].append(logits[:, -1:].argmax(-1))
                sync()
                times[kind].append(clock() - start)
    add_store_counters([c for kind, c in caches.items() if kind != "dynamic"], budget_options)
    return {kind: dict(step_s=times[kind], tokens=torch.cat(tokens[kind], dim=1).cpu()) for kind in kinds}


def summarize_steps(rounds: list[dict], generated: list, context: int, kinds: tuple[str, str]) -> dict:
    """The alternated rounds of two caches (``kinds``: the reference, then the one compared with it) as paired
    ratios: per step, the reference's time / the other's (the other's speed relative to the reference's), their
    median and quartiles; each cache's median step (ms); whether every round's reference tokens equal
    ``generate``'s (``generated``: its sequences, one per round) and whether the other's equal the reference's."""
    reference, other = kinds
    first = [t for r in rounds for t in r[reference]["step_s"]]
    second = [t for r in rounds for t in r[other]["step_s"]]
    pairs = [a / b for a, b in zip(first, second)]
    quartiles = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else [pairs[0]] * 3
    return dict(
        kinds=list(kinds), pairs=len(pairs), speed_ratio=statistics.median(pairs), speed_ratio_q1=quartiles[0],
        speed_ratio_q3=quartiles[2], ms_median={reference: 1000 * statistics.median(first),
                                                other: 1000 * statistics.median(second)},
        reference_equals_generate=all(bool((r[reference]["tokens"] == g[:, context:]).all())
                                      for r, g in zip(rounds, generated)),
        tokens_equal=all(bool((r[reference]["tokens"] == r[other]["tokens"]).all()) for r in rounds),
    )


def steps_alternated(kinds: tuple[str, str], generated: list, model, cfg: Config, inputs, args, sync,
                     budget_options: dict, bar) -> dict:
    """``args.repeats`` rounds of `alternate_decode_steps` of ``kinds``, summarized (`summarize_steps`)."""
    rounds = []
    for rep in range(args.repeats):
        bar.set_postfix_str(f"{cfg.name} steps alternated {' / '.join(kinds)} {rep + 1}")
        rounds.append(alternate_decode_steps(model, cfg, inputs, args.new_tokens, sync, kinds, args.budget,
                                             args.budget_page_size, budget_options))
        bar.update()
    return summarize_steps(rounds, generated, cfg.context, kinds)


def run_once(model, kind: str, cfg: Config, inputs, new_tokens: int, pad_id, seed: int, meter: MemoryMeter,
             sync, budget: int | None = None, budget_page_size: int | None = None,
             budget_options: dict | None = None) -> dict:
    import torch
    from transformers import LogitsProcessorList

    import hf_paged

    mode = parse_mode(cfg.mode)
    use_attention(model, kind)
    cache = fresh_cache(model, kind, cfg, budget, budget_page_size, budget_options)
    probe = StepProbe(kind, cache, sync)
    torch.manual_seed(seed)
    meter.start()
    sync()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **{hf_paged.CACHE_KWARG: cache}, max_new_tokens=new_tokens,
                             eos_token_id=None, pad_token_id=pad_id, logits_processor=LogitsProcessorList([probe]),
                             **mode["kwargs"])
    sync()
    total = time.perf_counter() - start - probe.overhead
    peak_mem = meter.stop()
    end_mem = cache_memory(cache)
    steps = len(probe.times)
    rows = inputs["input_ids"].shape[0] * mode["rows_per_prompt"]
    prefill_s = probe.times[0] - start
    decode_s = probe.times[-1] - probe.times[0]
    result = dict(
        steps=steps, rows=rows, total_s=total, prefill_s=prefill_s, decode_s=decode_s,
        prefill_tok_s=rows * inputs["input_ids"].shape[1] / prefill_s,
        decode_tok_s=rows * (steps - 1) / decode_s if steps > 1 and decode_s > 0 else float("nan"),
        kv_bytes_end=end_mem["kv_bytes"], kv_bytes_peak=max(probe.kv_peak, end_mem["kv_bytes"]),
        pool_bytes_end=end_mem["pool_bytes"], pool_bytes_peak=max(probe.pool_peak, end_mem["pool_bytes"]),
        peak_mem_growth_bytes=peak_mem,
    )
    result["attn_implementation"] = model.config._attn_implementation
    result["cache_class"] = type(cache).__name__
    if kind != "dynamic":
        add_store_counters([cache], budget_options)
        result["stats_end"] = cache.stats()
    if kind == "bounded":  # what the flags made of it
        result["eviction"] = dict(policy=cache.policy.name, score_signal=cache.policy.signal)
    sequences = out.cpu()
    del out, cache, probe
    return result, sequences


def ideal_kv_bytes(model, rows: int, tokens: int, dtype) -> int:
    """rows x tokens x layers x kv_heads x (head_dim for K + for V) x element size (no padding, no pages)."""
    import torch

    cfg = model.config.get_text_config(decoder=True)
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return rows * tokens * cfg.num_hidden_layers * heads * head_dim * 2 * torch.tensor([], dtype=dtype).element_size()


def summarize(cfg: Config, runs: dict[str, list[dict]], matches: list[bool], agreement: list[float],
              new_tokens: int, model, dtype) -> dict:
    med = lambda xs: statistics.median(xs)  # noqa: E731
    entry = dict(name=cfg.name, **asdict(cfg), new_tokens=new_tokens)
    entry["rows"] = runs["dynamic"][0]["rows"]
    entry["ideal_kv_bytes_end"] = ideal_kv_bytes(model, entry["rows"], cfg.context + new_tokens - 1, dtype)
    for kind in runs:
        rs = runs[kind]
        entry[kind] = dict(
            prefill_tok_s=med([r["prefill_tok_s"] for r in rs]),
            decode_tok_s=med([r["decode_tok_s"] for r in rs]),
            prefill_s=med([r["prefill_s"] for r in rs]),
            decode_s=med([r["decode_s"] for r in rs]),
            total_s=med([r["total_s"] for r in rs]),
            decode_ms_per_step=1000 * med([r["decode_s"] / max(1, r["steps"] - 1) for r in rs]),
            kv_bytes_end=rs[-1]["kv_bytes_end"],
            kv_bytes_peak=max(r["kv_bytes_peak"] for r in rs),
            pool_bytes_end=rs[-1]["pool_bytes_end"],
            pool_bytes_peak=max(r["pool_bytes_peak"] for r in rs),
            peak_mem_growth_bytes=med([r["peak_mem_growth_bytes"] for r in rs]),
            runs=rs,
        )
    d, p = entry["dynamic"], entry["paged"]
    entry["ratios"] = {k: (p[k] / d[k] if d[k] else float("nan")) for k in RATIO_KEYS}
    if "bounded" in entry:
        entry["bounded"]["decode_vs_unbounded"] = entry["bounded"]["decode_tok_s"] / p["decode_tok_s"]
    entry["tokens_match"] = all(matches)
    entry["token_agreement"] = min(agreement)
    return entry


RATIO_KEYS = ("prefill_tok_s", "decode_tok_s", "kv_bytes_end", "kv_bytes_peak", "pool_bytes_peak",
              "peak_mem_growth_bytes")
SPEED_KEYS = ("prefill_tok_s", "decode_tok_s")
NOISE = 0.20  # repetitions whose (max - min) / median exceeds this make a speed ratio "noisy", not a result


def spread(config: dict, kind: str, key: str) -> float | None:
    """(max - min) / median of ``key`` over one cache's repetitions of a configuration; None with one repetition."""
    values = [r[key] for r in config[kind]["runs"]]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def noisy(config: dict, key: str) -> float | None:
    """The larger spread of the two caches' ``key`` when it exceeds NOISE, else None (the ratio stands)."""
    worst = max((spread(config, kind, key) or 0.0) for kind in CACHES)
    return worst if worst > NOISE else None


def ratio_text(config: dict, key: str) -> str:
    """The paged / dynamic ratio of ``key``, marked "noisy (N%)" when the repetitions disagree by more than NOISE."""
    worst = noisy(config, key)
    ratio = f"{config['ratios'][key]:.2f}"
    return f"{ratio} (noisy, {100 * worst:.0f}%)" if worst is not None else ratio


def compare(a, b, prompt_len: int) -> tuple[bool, float]:
    if a.shape != b.shape:
        return False, 0.0
    new_a, new_b = a[:, prompt_len:], b[:, prompt_len:]
    return bool((a == b).all()), float((new_a == new_b).float().mean()) if new_a.numel() else 1.0


# --------------------------------------------------------------------------------------- output
def markdown_table(configs: list[dict]) -> str:
    head = ("| context | batch | mode | rows | page | prefill tok/s dyn | paged | ratio | decode tok/s dyn | paged | "
            "ratio | decode spread % dyn / paged | KV end MiB dyn | paged | KV peak MiB dyn | paged | paged pool peak "
            "MiB | peak mem growth MiB dyn | paged | tokens match |")
    sep = "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"
    lines = [head, sep]
    for c in configs:
        d, p = c["dynamic"], c["paged"]
        spreads = [spread(c, kind, "decode_tok_s") for kind in CACHES]
        spread_cell = "—" if None in spreads else " / ".join(f"{100 * v:.0f}" for v in spreads)
        lines.append(
            f"| {c['context']} | {c['batch']} | {c['mode']} | {c['rows']} | {c['page_size']} "
            f"| {d['prefill_tok_s']:.1f} | {p['prefill_tok_s']:.1f} | {ratio_text(c, 'prefill_tok_s')} "
            f"| {d['decode_tok_s']:.2f} | {p['decode_tok_s']:.2f} | {ratio_text(c, 'decode_tok_s')} | {spread_cell} "
            f"| {mib(d['kv_bytes_end'])} | {mib(p['kv_bytes_end'])} | {mib(d['kv_bytes_peak'])} "
            f"| {mib(p['kv_bytes_peak'])} | {mib(p['pool_bytes_peak'])} | {mib(d['peak_mem_growth_bytes'])} "
            f"| {mib(p['peak_mem_growth_bytes'])} | {'yes' if c['tokens_match'] else 'NO'} |")
    return "\n".join(lines)


def bounded_table(configs: list[dict], budget: int, budget_page_size: int | None = None, eviction: str | None = None,
                  per_layer: str | None = None, signal: str | None = None, per_head: bool = False,
                  interval: int | None = None) -> str:
    """Decode speed of the bounded PagedCache (``--budget``) against the unbounded one, same runs."""
    policy = f"eviction {eviction or 'score (the default)'}" + (" per KV head" if per_head else "")
    policy += f", per_layer_eviction {per_layer}" if per_layer else ""
    policy += f", score_signal {signal}" if signal else ""
    policy += f", eviction_interval {interval}" if interval else ""
    lines = [f"Bounded PagedCache (at most {budget} tokens per row and layer, {policy}, a longer prompt "
             "cut to it after prefill) against the unbounded PagedCache, alternated in the same run:", "",
             "| context | batch | mode | page unbounded / bounded | decode tok/s unbounded | bounded | "
             "bounded / unbounded | spread % "
             "unbounded / bounded | steps alternated: bounded / unbounded (quartiles) | ms per step unbounded / "
             "bounded | tokens held per layer at end (all rows) | evictions (all layers) | "
             "new tokens equal to unbounded |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in configs:
        p, b = c["paged"], c["bounded"]
        spreads = [spread(c, kind, "decode_tok_s") for kind in ("paged", "bounded")]
        spread_cell = "—" if None in spreads else " / ".join(f"{100 * v:.0f}" for v in spreads)
        worst = max(v or 0.0 for v in spreads)
        ratio = f"{b['decode_vs_unbounded']:.2f}" + (f" (noisy, {100 * worst:.0f}%)" if worst > NOISE else "")
        stats = b["runs"][-1]["stats_end"]
        pages = f"{c['page_size']} / {budget_page_size or c['page_size']}"
        steps = c.get("bounded_steps")
        step_cells = (f"— ({'greedy only' if 'bounded_steps' in c else 'not measured'}) | —" if steps is None else
                      f"{steps['speed_ratio']:.2f} ({steps['speed_ratio_q1']:.2f}–{steps['speed_ratio_q3']:.2f}) "
                      f"| {steps['ms_median']['paged']:.1f} / {steps['ms_median']['bounded']:.1f}")
        lines.append(f"| {c['context']} | {c['batch']} | {c['mode']} | {pages} | {p['decode_tok_s']:.2f} "
                     f"| {b['decode_tok_s']:.2f} | {ratio} | {spread_cell} | {step_cells} | {stats['tokens_held']} "
                     f"| {stats['evictions']} | {100 * c['bounded_agreement']:.0f}% |")
    measured = [c["bounded_steps"] for c in configs if c.get("bounded_steps")]
    if measured:
        same = "yes" if all(m["reference_equals_generate"] for m in measured) else "NO"
        lines += ["", "steps alternated: the two caches decode greedily taking turns token by token, one round per "
                  "repeat (`alternate_decode_steps`); per step the unbounded step's time (CPU-seconds on the CPU) over "
                  "the bounded one's, the median and quartiles of those pairs. Unlike whole runs, the pairs share the "
                  "machine's load. The "
                  f"unbounded cache's tokens in every round equal its `generate` run's: {same}."]
    return "\n".join(lines)


def alternated_table(configs: list[dict]) -> str:
    """``--alternate``: PagedCache against DynamicCache in decode steps taking turns (greedy configurations)."""
    lines = ["PagedCache + hf_paged against DynamicCache + sdpa, decode steps alternated (`--alternate`):", "",
             "| context | batch | page | steps alternated: paged / dynamic (quartiles) | ms per step dynamic / paged "
             "| steps | new tokens equal |", "|---|---|---|---|---|---|---|"]
    measured = [c for c in configs if c.get("alternated_steps")]
    for c in measured:
        steps = c["alternated_steps"]
        ms = steps["ms_median"]
        lines.append(f"| {c['context']} | {c['batch']} | {c['page_size']} | {steps['speed_ratio']:.3f} "
                     f"({steps['speed_ratio_q1']:.3f}–{steps['speed_ratio_q3']:.3f}) | {ms['dynamic']:.1f} / "
                     f"{ms['paged']:.1f} | {steps['pairs']} | {'yes' if steps['tokens_equal'] else 'NO'} |")
    if measured:
        same = "yes" if all(c["alternated_steps"]["reference_equals_generate"] for c in measured) else "NO"
        lines += ["", "One round per repeat in which the two caches decode greedily taking turns token by token, the "
                  "model switching attention between their steps (`alternate_decode_steps`); per step DynamicCache's "
                  "time (CPU-seconds on the CPU) over PagedCache's: above 1, the paged step is faster. The median and "
                  f"quartiles of those pairs. DynamicCache's tokens in every round equal its `generate` run's: {same}."]
    return "\n".join(lines)


def markdown_report(result: dict) -> str:
    s, e = result["settings"], result["environment"]
    smoke = (["**Smoke test (`--quick`): tiny contexts, one repetition, a few tokens, to check that everything "
              "runs; these speeds and ratios are not results.**", ""] if s.get("quick") else [])
    return "\n".join([
        "# hf_paged benchmark: PagedCache + hf_paged vs DynamicCache + sdpa",
        "",
        *smoke,
        f"model `{s['model']}` ({e['model_class']}, {e['num_layers']} layers), dtype {s['dtype']}, device "
        f"{e['device']} ({e['device_name']}), torch threads {e['torch_threads']}, new tokens {s['new_tokens']}, "
        f"repeats {s['repeats']} (medians), warm-up {s['warmup']} {'full' if s['full_warmup'] else 'short'}.",
        f"torch {e['torch']}, transformers {e['transformers']}, hf_paged {e['hf_paged']} (source sha256 "
        f"{e.get('hf_paged_source_sha256', 'not recorded')}), python {e['python']}, "
        f"{e['platform']}. Wall time {result['wall_s']:.0f} s.",
        "",
        markdown_table(result["configs"]),
        "",
        *([bounded_table(result["configs"], s["budget"], s.get("budget_page_size"), s.get("budget_eviction"),
                        s.get("budget_per_layer"), s.get("budget_score_signal"), s.get("per_head", False),
                        s.get("budget_eviction_interval")), ""]
          if s.get("budget") else []),
        *([alternated_table(result["configs"]), ""] if s.get("alternate") else []),
        "ratio = paged / dynamic. rows = batch x beams (beamN) or x returned sequences (sampleN). prefill tok/s = "
        "rows x context / time to the first token; decode tok/s = rows x (new tokens - 1) / time from the first "
        "to the last token. KV: DynamicCache layers' keys+values nbytes; PagedCache stats()['kv_bytes'] "
        "(used + cached pages); pool = allocated page pool. Peak KV is sampled after every forward step. "
        f"spread = (max - min) / median over the repeats; a ratio whose repeats spread more than {100 * NOISE:.0f}% "
        "(either cache) is marked \"noisy\": rerun on a quieter machine or with --threads 1.",
        f"peak mem growth: {e['memory_method']}.",
        *([f"Prefix store {store_text(result['prefix_store'])}."] if result.get("prefix_store") else []),
        "",
    ])


MODE_MARKERS = {"greedy": "o", "beam": "s", "sample": "^"}  # fixed meanings, the same in every run
BATCH_COLORS = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:red", "tab:brown"]  # batch 1, 2, 4, 8, ...


def series_style(batch: int, mode: str, page_size: int) -> dict:
    """Marker by mode kind, colour by batch size, filled and solid for page size 16 (hollow, dashed otherwise)."""
    kind = re.match(r"[a-z]+", mode).group(0)
    color = BATCH_COLORS[min(max(batch, 1).bit_length() - 1, len(BATCH_COLORS) - 1)]
    default_page = page_size == BASE["page_size"]
    return dict(marker=MODE_MARKERS.get(kind, "D"), color=color, markersize=8, linestyle="-" if default_page else "--",
                markerfacecolor=color if default_page else "white", markeredgewidth=1.5)


def plot(result: dict, path: Path) -> None:
    """Two panels, each a ratio against DynamicCache + sdpa (= 1): decode speed and peak KV memory, against
    context. One series per (batch, mode, page size), styled by :func:`series_style`; series sharing a
    context are spread slightly sideways so that none hides another, and each point is labelled."""
    plt = pyplot()
    configs = result["configs"]
    smoke = result["settings"].get("quick")
    fig, (speed, memory) = plt.subplots(1, 2, figsize=(13, 5.5))
    groups = sorted({(c["batch"], c["mode"], c["page_size"]) for c in configs}, key=lambda g: (g[1] != "greedy", g))
    for i, (batch, mode, page) in enumerate(groups):
        pts = sorted((c for c in configs if (c["batch"], c["mode"], c["page_size"]) == (batch, mode, page)),
                     key=lambda c: c["context"])
        dodge = 2 ** (0.08 * (i - (len(groups) - 1) / 2))
        xs = [c["context"] * dodge for c in pts]
        style = series_style(batch, mode, page)
        label = f"batch {batch}, {mode}, page {page}"
        for ax, key in ((speed, "decode_tok_s"), (memory, "kv_bytes_peak")):
            ys = [c["ratios"][key] for c in pts]
            ax.plot(xs, ys, label=label, **style)
            for x, y, c in zip(xs, ys, pts):
                if key in SPEED_KEYS and noisy(c, key) is not None:
                    ax.annotate("noisy", (x, y), textcoords="offset points", xytext=(0, -14), ha="center",
                                fontsize=7, color="red")
                elif key == "kv_bytes_peak" and y < 0.9:
                    ax.annotate(f"{y:.2f} ({1 / y:.1f}x less)", (x, y), textcoords="offset points", xytext=(8, -3),
                                fontsize=8, color=style["color"])
                elif key == "decode_tok_s":
                    ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(8 if i % 2 else -8, -3),
                                ha="left" if i % 2 else "right", fontsize=7, color=style["color"])  # alternate sides
    contexts = sorted({c["context"] for c in configs})
    for ax, title, ylabel in (
            (speed, "decode speed (higher is better)", "decode tokens/s, PagedCache / DynamicCache"),
            (memory, "peak KV memory (lower is better)", "peak KV bytes, PagedCache / DynamicCache")):
        ax.axhline(1.0, color="black", lw=1, label="DynamicCache + sdpa (= 1)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [str(c) for c in contexts])
        ax.minorticks_off()
        ax.set_xlim(contexts[0] / 1.5, contexts[-1] * 1.5)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(ylabel)
        ax.set_title(("SMOKE TEST, not a result: " if smoke else "") + title, fontsize=10)
        ax.grid(True, alpha=0.3)
    memory.set_ylim(0, max(1.15, max(c["ratios"]["kv_bytes_peak"] for c in configs) * 1.1))
    handles, labels = speed.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    e, s = result["environment"], result["settings"]
    fig.suptitle(f"PagedCache + hf_paged vs DynamicCache + sdpa: {s['model']} {s['dtype']} on {e['device']} "
                 f"({e['torch_threads']} threads), {s['new_tokens']} new tokens, median of {s['repeats']}. "
                 "Marker: mode; colour: batch; hollow/dashed: page size other than 16", fontsize=9)
    fig.tight_layout(rect=(0, 0.04 + 0.03 * ((len(labels) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------- main
def write_outputs(result: dict, out: Path) -> str:
    """benchmark.md, .json and .png of ``result`` in ``out``; -> the markdown."""
    report = markdown_report(result)
    write_report(out, "benchmark", report, result, lambda path: plot(result, path), indent=1, strict=False)
    return report


def main(args, argv: list[str]) -> dict:
    """Run the configurations of ``args`` (scripts/benchmark.py's arguments, ``argv`` as given, recorded), or with
    ``args.replot`` only rewrite a stored run's outputs; -> the result written to ``args.out``."""
    if args.replot:
        result = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        print(write_outputs(result, Path(args.out)))
        return result
    configs = build_configs(args)
    wall_start = time.perf_counter()

    import torch
    import transformers
    from tqdm.auto import tqdm

    import hf_paged

    hf_paged_source = source_fingerprint(hf_paged)  # now: the package may be edited while this runs
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = ((torch.bfloat16 if device.type == "cuda" else torch.float32) if args.dtype == "auto"
             else getattr(torch, args.dtype))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    model_name = args.model or assets.DEFAULT_MODEL

    model, tokenizer = assets.load_model_and_tokenizer(model_name, dtype=dtype, device=device,
                                                       attn_implementation="sdpa")
    pad_id = tokenizer.pad_token_id
    token_ids = tokenizer(assets.britannica_text(), add_special_tokens=False)["input_ids"]
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None:
        too_long = [c.name for c in configs if c.context + args.new_tokens > max_pos]
        if too_long:
            raise SystemExit(f"context + new tokens exceed the model's {max_pos} positions: {too_long}")
    meter = MemoryMeter(device)

    environment = dict(
        **versions(("torch", "transformers", "hf_paged")),
        hf_paged_source_sha256=hf_paged_source, hf_paged_path=str(Path(hf_paged.__file__).parent),
        processor=platform.processor(),
        device=str(device), device_name=(torch.cuda.get_device_name(device) if device.type == "cuda"
                                         else f"{os.cpu_count()} CPU cores"),
        torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
        model_class=type(model).__name__, num_layers=model.config.get_text_config(decoder=True).num_hidden_layers,
        text_tokens=len(token_ids), memory_method=meter.method,
        load_avg_start=load_average(),
    )
    settings = dict(model=model_name, dtype=str(dtype).replace("torch.", ""), new_tokens=args.new_tokens,
                    repeats=args.repeats, warmup=args.warmup, full_warmup=args.full_warmup, quick=args.quick,
                    seed=args.seed, budget=args.budget, budget_page_size=args.budget_page_size,
                    budget_eviction=args.budget_eviction, budget_per_layer=args.budget_per_layer,
                    budget_score_signal=args.budget_score_signal, per_head=getattr(args, "per_head", False),
                    budget_eviction_interval=getattr(args, "budget_eviction_interval", None),
                    alternate=args.alternate,
                    kv_format=args.kv_format,
                    prefix_store=args.prefix_store, argv=list(argv),
                    configs=[c.name for c in configs], attention={k: v for k, v in ATTN.items()})

    store = StudyStore(args.prefix_store)
    # PagedCache arguments: every one's format and prefix store, the bounded one's flags
    budget_options = {"kv_format": args.kv_format, "store": store}
    if args.budget_eviction:
        budget_options["eviction"] = args.budget_eviction
    if args.budget_per_layer:
        budget_options["per_layer_eviction"] = args.budget_per_layer == "on"
    if args.budget_score_signal:
        budget_options["score_signal"] = args.budget_score_signal
    if getattr(args, "budget_eviction_interval", None):
        budget_options["eviction_interval"] = args.budget_eviction_interval
    if getattr(args, "per_head", False):
        budget_options["per_head_eviction"] = True
    results = []
    kinds = CACHES + (("bounded",) if args.budget else ())
    step_rounds = args.repeats * (bool(args.budget) + bool(args.alternate))  # per greedy configuration
    total_runs = sum(len(kinds) * (args.warmup + args.repeats) + (step_rounds if c.mode == "greedy" else 0)
                     for c in configs)
    with tqdm(total=total_runs, disable=args.no_progress, desc="benchmark", file=sys.stderr) as bar:
        for cfg in configs:
            cfg_start = time.perf_counter()
            inputs = prompt_batch(token_ids, cfg.context, cfg.batch, device)
            warm_ctx = cfg.context if args.full_warmup else min(cfg.context, 64)
            warm_inputs = {k: v[:, -warm_ctx:] for k, v in inputs.items()}
            warm_tokens = args.new_tokens if args.full_warmup else min(args.new_tokens, 4)
            for i in range(args.warmup):
                for kind in kinds:
                    bar.set_postfix_str(f"{cfg.name} warm-up {kind}")
                    run_once(model, kind, cfg, warm_inputs, warm_tokens, pad_id, args.seed, meter, sync, args.budget,
                             args.budget_page_size, budget_options)
                    bar.update()
            runs = {k: [] for k in kinds}
            matches, agreement, bounded_agreement, generated, generated_dynamic = [], [], [], [], []
            for rep in range(args.repeats):
                order = kinds if rep % 2 == 0 else kinds[::-1]
                seqs = {}
                for kind in order:
                    bar.set_postfix_str(f"{cfg.name} repeat {rep + 1} {kind}")
                    res, seqs[kind] = run_once(model, kind, cfg, inputs, args.new_tokens, pad_id, args.seed + rep,
                                               meter, sync, args.budget, args.budget_page_size, budget_options)
                    runs[kind].append(res)
                    bar.update()
                generated_dynamic.append(seqs["dynamic"])
                same, frac = compare(seqs["dynamic"], seqs["paged"], cfg.context)
                matches.append(same)
                agreement.append(frac)
                if args.budget:
                    bounded_agreement.append(compare(seqs["paged"], seqs["bounded"], cfg.context)[1])
                    generated.append(seqs["paged"])
            entry = summarize(cfg, runs, matches, agreement, args.new_tokens, model, dtype)
            if args.budget:
                entry["bounded_agreement"] = min(bounded_agreement)
                entry["bounded_steps"] = None  # greedy only: other modes decode several rows per prompt
                if cfg.mode == "greedy":
                    entry["bounded_steps"] = steps_alternated(
                        ("paged", "bounded"), generated, model, cfg, inputs, args, sync, budget_options, bar)
            if args.alternate and cfg.mode == "greedy":
                entry["alternated_steps"] = steps_alternated(
                    ("dynamic", "paged"), generated_dynamic, model, cfg, inputs, args, sync, budget_options, bar)
            entry["deterministic_mode"] = parse_mode(cfg.mode)["deterministic"]
            entry["wall_s"] = time.perf_counter() - cfg_start
            results.append(entry)
            tqdm.write(f"{cfg.name}: decode tok/s dynamic {entry['dynamic']['decode_tok_s']:.2f} paged "
                       f"{entry['paged']['decode_tok_s']:.2f} (ratio {ratio_text(entry, 'decode_tok_s')}), tokens "
                       f"match {entry['tokens_match']}", file=sys.stderr)
            if entry.get("alternated_steps"):
                steps = entry["alternated_steps"]
                tqdm.write(f"{cfg.name}: paged / dynamic decode speed, {steps['pairs']} steps alternated: "
                           f"{steps['speed_ratio']:.3f} (quartiles {steps['speed_ratio_q1']:.3f}–"
                           f"{steps['speed_ratio_q3']:.3f})", file=sys.stderr)
            if entry.get("bounded_steps"):
                steps = entry["bounded_steps"]
                tqdm.write(f"{cfg.name}: bounded / unbounded decode speed, {steps['pairs']} steps alternated: "
                           f"{steps['speed_ratio']:.3f} (quartiles {steps['speed_ratio_q1']:.3f}–"
                           f"{steps['speed_ratio_q3']:.3f})", file=sys.stderr)

    environment["load_avg_end"] = load_average()
    result = dict(settings=settings, environment=environment, configs=results,
                  wall_s=time.perf_counter() - wall_start, prefix_store=store.close("benchmark PagedCache"))
    out = Path(args.out)
    report = write_outputs(result, out)
    print(report)
    print(f"wrote {out / 'benchmark.md'}, {out / 'benchmark.json'}, {out / 'benchmark.png'}", file=sys.stderr)
    return result

