"""Perplexity of a causal LM with DynamicCache vs PagedCache, unbounded and under eviction policies.

Two modes, over any text that ``datasets`` can load (documents joined with "\\n\\n", tokenized once):

``--mode strided`` (the transformers perplexity guide): windows of ``--window`` tokens every
``--stride`` tokens, the overlap masked out of the labels (-100); every window is a fresh cache and
a ``use_cache=True`` forward, so the cache is really written and read. DynamicCache + "sdpa" and
PagedCache + "hf_paged" must agree within ``--tolerance`` (relative).

``--mode streaming`` (StreamingLLM's long-text evaluation): the text goes through ONE cache in
chunks of ``--chunk`` tokens (default: one page), with explicit ``position_ids`` continuing the
processed count; every next token is scored given what the cache still holds plus the chunk. Rows:
DynamicCache (full), PagedCache unbounded (must equal full within ``--tolerance``), and for every
``--budgets`` value B (tokens, ``max_pages = B // page_size``): ``score`` (the default), ``lru``, ``fifo+sinks``
(``sink_pages`` = enough pages for 4 tokens) and ``fifo`` without sinks (``sink_pages=0``).

Examples:
    python scripts/perplexity.py --mode streaming                       # Britannica, 2048 tokens (README)
    python scripts/perplexity.py --quick                                # smoke test, 256 tokens
    python scripts/perplexity.py --mode strided --max-tokens 0          # the whole text
    python scripts/perplexity.py --dataset wikitext --config wikitext-2-raw-v1 --split test
    python scripts/perplexity.py --text-file notes.txt --model HuggingFaceTB/SmolLM2-360M

Several processes (``accelerate launch`` or ``torchrun``; one process needs no launcher):
    accelerate launch --config_file integrations/accelerate/cpu_2proc.yaml scripts/perplexity.py
    torchrun --nproc_per_node 2 scripts/perplexity.py --mode strided
The strided windows, and in streaming mode the cache configurations (one stream cannot be cut
without changing what the cache holds), are split between the ranks with
``PartialState.split_between_processes``; NLL sums and token counts come back through
``accelerate.utils.gather_object`` and are added in a fixed order, so the numbers do not depend on
the number of processes. Only the main process writes.

Writes ``--out``/perplexity.md (the table, also printed), perplexity.json (every number, settings,
versions) and perplexity.png. In streaming mode they also count, per ``--segment`` tokens, the segments
where each policy's perplexity is below or above fifo+sinks' at the same budget (and fifo+sinks' below or
above the full cache's): one text's perplexity differences between policies are often a few segments'
doing; and each policy's perplexity relative to that reference with a paired bootstrap interval over
blocks of ``--block`` tokens (an interval that excludes 0: a difference that holds across the text).
``--replot JSON`` rewrites the three files from an earlier perplexity.json without running anything. Exit status 1 when a parity check fails or a row raised.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

import hf_paged  # noqa: E402  (registers the "hf_paged" attention)
from common import int_list, make_cache  # noqa: E402
from hf_paged import assets  # noqa: E402
from hf_paged.eviction import default_sink_pages  # noqa: E402

POLICIES = ("score", "lru", "fifo+sinks", "fifo")
# What the README's table is made of, and what --quick shortens it to.
DEFAULTS = dict(max_tokens=2048, budgets="128,256,512,1024")
QUICK = dict(max_tokens=256, budgets="64,128")


# ------------------------------------------------------------------------------------ arguments
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", choices=("strided", "streaming"), default="streaming")
    p.add_argument("--model", default=assets.DEFAULT_MODEL, help="'smollm2' (embedded), a local folder or a hub id")
    p.add_argument("--dtype", choices=sorted(assets.DTYPES), default="float32")
    p.add_argument("--dataset", default=None, help="datasets name or path; none: the embedded Britannica article")
    p.add_argument("--config", default=None, help="dataset config name")
    p.add_argument("--split", default="train")
    p.add_argument("--column", default="text")
    p.add_argument("--text-file", default=None, help="local text file, one document per paragraph")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"use the first N tokens of the text (0: all; default {DEFAULTS['max_tokens']}, "
                        f"--quick {QUICK['max_tokens']})")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--window", type=int, default=512, help="strided: tokens per window")
    p.add_argument("--stride", type=int, default=256, help="strided: window step (the scored tokens per window)")
    p.add_argument("--chunk", type=int, default=None, help="streaming: tokens per forward; none: one page")
    p.add_argument("--budgets", type=int_list, default=None,
                   help=f"streaming: KV budgets in tokens, max_pages = budget // page size (default "
                        f"{DEFAULTS['budgets']}, --quick {QUICK['budgets']})")
    p.add_argument("--quick", action="store_true",
                   help="smoke test (seconds, not a result): the --quick values of --max-tokens and --budgets")
    p.add_argument("--lru-threshold", type=float, default=None,
                   help="streaming: PagedCache(lru_threshold=...) for the lru rows; none: PagedCache's default")
    p.add_argument("--segment", type=int, default=512, help="streaming: also report perplexity per segment of N tokens")
    p.add_argument("--block", type=int, default=64, help="streaming: tokens per block of the paired bootstrap "
                   "interval of each policy's perplexity against its reference's")
    p.add_argument("--tolerance", type=float, default=1e-4, help="relative tolerance of the parity checks")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process; none: torch's default")
    p.add_argument("--cpu", action="store_true", help="run on CPU even if GPUs are present")
    p.add_argument("--out", default="runs/perplexity",
                   help="output folder (git-ignored runs/; the README's reference results are in results/perplexity)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="run nothing: rewrite perplexity.md/.json/.png in --out from an earlier perplexity.json")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, int_list(value) if key == "budgets" else value)
    for name in ("page_size", "window", "stride", "segment", "block"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.chunk is None:
        args.chunk = args.page_size
    if args.chunk <= 0:
        p.error("--chunk must be positive")
    if args.stride > args.window:
        p.error("--stride must not exceed --window (tokens would be skipped)")
    if args.max_tokens < 0:
        p.error("--max-tokens must be >= 0")
    if args.mode == "streaming" and min(args.budgets) < args.page_size:
        p.error(f"--budgets must be at least one page ({args.page_size} tokens)")
    return args


# ----------------------------------------------------------------------------------------- text
def load_token_ids(args, tokenizer) -> tuple[torch.Tensor, dict]:
    """The documents joined with "\\n\\n", tokenized once, cut to ``--max-tokens``: (1-D ids, info).

    With a token limit only a prefix of the documents is tokenized (16 characters per wanted
    token, doubled until the limit is reached), so a large dataset is not tokenized whole.
    """
    ds = assets.load_text_dataset(args.dataset, args.config, split=args.split, column=args.column,
                                  text_file=args.text_file)
    docs = [t for t in ds[args.column] if isinstance(t, str) and t.strip()]
    if not docs:
        raise ValueError(f"no non-empty text in column {args.column!r}")
    chars = 16 * args.max_tokens if args.max_tokens else None
    while True:
        used, total = [], 0
        for doc in docs:
            if chars is not None and total >= chars:
                break
            used.append(doc)
            total += len(doc) + 2
        text = "\n\n".join(used)
        ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[0]
        if chars is None or len(ids) >= args.max_tokens or len(used) == len(docs):
            break
        chars *= 2
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    source = args.text_file or args.dataset or "britannica (embedded, hf_paged.assets)"
    info = dict(source=source, config=args.config, split=None if args.text_file or not args.dataset else args.split,
                column=args.column, documents_total=len(docs), documents_used=len(used),
                chars_tokenized=len(text), tokens=len(ids))
    return ids, info


# ---------------------------------------------------------------------------------------- caches
def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """-log p(target) per position, float64; ``logits [T, V]``, ``targets [T]``."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return -logprobs.gather(-1, targets[:, None])[:, 0].double()


def relative_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


def ppl(nll_sum: float, tokens: int) -> float:
    return math.exp(nll_sum / tokens) if tokens else float("nan")


# --------------------------------------------------------------------------------------- strided
def strided_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, target_len) per window, as in the transformers perplexity guide."""
    out, prev_end = [], 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        out.append((begin, end, end - prev_end))
        prev_end = end
        if end == n:
            break
    return out


@torch.no_grad()
def window_nll(model, cache, ids: torch.Tensor, begin: int, end: int, target_len: int, device) -> tuple[float, int]:
    """NLL sum and count of one window: labels are -100 on the overlap with the previous window."""
    input_ids = ids[begin:end][None].to(device)
    labels = input_ids.clone()
    labels[:, :-target_len] = -100
    logits = model(input_ids=input_ids, **{hf_paged.CACHE_KWARG: cache}, use_cache=True).logits[0, :-1]
    targets = labels[0, 1:]
    keep = targets != -100
    if cache.get_seq_length() != end - begin:
        raise RuntimeError(f"cache holds {cache.get_seq_length()} tokens after a window of {end - begin}")
    return float(token_nll(logits[keep], targets[keep]).sum()), int(keep.sum())


def run_strided(args, state, models, ids, progress) -> dict:
    from accelerate.utils import gather_object

    from hf_paged.distributed import deal

    windows = strided_windows(len(ids), args.window, args.stride)
    numbered = list(enumerate(windows))
    records = []
    with state.split_between_processes(deal(numbered, state.num_processes)) as mine:
        bar = progress(total=len(mine), desc=f"strided windows (rank {state.process_index})")
        for idx, (begin, end, trg) in mine:
            rec = dict(index=idx, begin=begin, end=end, target_len=trg, rank=state.process_index)
            for kind in ("dynamic", "paged"):
                model = models[kind]
                t0 = time.perf_counter()
                nll, count = window_nll(model, make_cache(kind, model, args.page_size), ids, begin, end, trg,
                                        state.device)
                rec[f"{kind}_nll_sum"], rec["tokens"] = nll, count
                rec[f"{kind}_wall_s"] = time.perf_counter() - t0
            records.append(rec)
            bar.update(1)
        bar.close()
    records = sorted(gather_object(records), key=lambda r: r["index"])
    tokens = sum(r["tokens"] for r in records)
    rows = []
    for kind, label, cache_name, attn in (("dynamic", "DynamicCache", "DynamicCache", "sdpa"),
                                         ("paged", "PagedCache", f"PagedCache(page_size={args.page_size})",
                                          "hf_paged")):
        nll = math.fsum(r[f"{kind}_nll_sum"] for r in records)
        rows.append(dict(name=kind, label=label, cache=cache_name, attn_implementation=attn, nll_sum=nll,
                         tokens=tokens, perplexity=ppl(nll, tokens),
                         wall_s=sum(r[f"{kind}_wall_s"] for r in records)))
    rel = relative_diff(rows[1]["perplexity"], rows[0]["perplexity"])
    parity = dict(compare="PagedCache vs DynamicCache", relative_diff=rel, tolerance=args.tolerance,
                  ok=rel <= args.tolerance)
    return dict(rows=rows, windows=records, parity=parity)


# ------------------------------------------------------------------------------------- streaming
def streaming_configs(args) -> list[dict]:
    configs = [
        dict(name="full", label="DynamicCache (full)", kind="dynamic", policy="full", budget=None, max_pages=None),
        dict(name="unbounded", label="PagedCache unbounded", kind="paged", policy="unbounded", budget=None,
             max_pages=None, policy_kwargs={}),
    ]
    sinks = default_sink_pages(args.page_size)
    kwargs = {"score": dict(eviction="score", sink_pages=sinks), "lru": dict(eviction="lru", sink_pages=sinks),
              "fifo+sinks": dict(eviction="fifo", sink_pages=sinks),
              "fifo": dict(eviction="fifo", sink_pages=0)}
    if args.lru_threshold is not None:
        kwargs["lru"]["lru_threshold"] = args.lru_threshold
    for budget in args.budgets:
        for policy in POLICIES:
            configs.append(dict(name=f"{policy}@{budget}", label=f"PagedCache {policy}", kind="paged", policy=policy,
                                budget=budget, max_pages=budget // args.page_size, policy_kwargs=kwargs[policy]))
    return configs


@torch.no_grad()
def stream(model, cache, ids: torch.Tensor, chunk: int, device, bar=None) -> torch.Tensor:
    """Feed ``ids[:-1]`` in chunks through one cache; NLL of every token 1..n-1 (float64, [n-1])."""
    n = len(ids)
    nll = torch.empty(n - 1, dtype=torch.float64)
    for start in range(0, n - 1, chunk):
        end = min(start + chunk, n - 1)
        if cache.get_seq_length() != start:
            raise RuntimeError(f"cache counts {cache.get_seq_length()} processed tokens, expected {start}")
        position_ids = torch.arange(start, end, device=device)[None]
        logits = model(input_ids=ids[start:end][None].to(device), position_ids=position_ids, **{hf_paged.CACHE_KWARG: cache},
                       use_cache=True).logits[0]
        nll[start:end] = token_nll(logits, ids[start + 1:end + 1].to(device)).cpu()
        if bar is not None:
            bar.update(end - start)
    return nll


def run_streaming(args, state, models, ids, progress) -> dict:
    from accelerate.utils import gather_object

    from hf_paged.distributed import deal

    configs = streaming_configs(args)
    results = []
    with state.split_between_processes(deal(list(enumerate(configs)), state.num_processes)) as mine:  # round-robin
        for idx, cfg in mine:
            res = dict(index=idx, rank=state.process_index)
            bar = progress(total=len(ids) - 1, desc=f"{cfg['name']} (rank {state.process_index})")
            t0 = time.perf_counter()
            try:
                model = models[cfg["kind"]]
                paged_kwargs = dict(max_pages=cfg["max_pages"], **cfg["policy_kwargs"]) if cfg["kind"] == "paged" else {}
                cache = make_cache(cfg["kind"], model, args.page_size, **paged_kwargs)
                nll = stream(model, cache, ids, args.chunk, state.device, bar)
            except Exception as exc:  # noqa: BLE001  a row that fails is reported, the others still run
                res["error"] = f"{type(exc).__name__}: {exc}"
            else:
                res["nll_sum"] = math.fsum(nll.tolist())
                res["tokens"] = len(nll)
                seg = args.segment
                res["segments"] = [dict(start=s + 1, end=min(s + seg, len(nll)) + 1,
                                        perplexity=ppl(math.fsum(nll[s:s + seg].tolist()), len(nll[s:s + seg])))
                                   for s in range(0, len(nll), seg)]
                res["block_nll"] = [math.fsum(nll[s:s + args.block].tolist()) for s in range(0, len(nll), args.block)]
                if isinstance(cache, hf_paged.PagedCache):
                    res["stats"] = cache.stats()
                res["tokens_held"] = _tokens_held(cache)
            res["wall_s"] = time.perf_counter() - t0
            bar.close()
            results.append(res)
    gathered = {r["index"]: r for r in gather_object(results)}
    rows = []
    for i, cfg in enumerate(configs):
        row = {k: v for k, v in cfg.items() if k != "kind"}
        row["cache"] = "DynamicCache" if cfg["kind"] == "dynamic" else "PagedCache"
        row["attn_implementation"] = "sdpa" if cfg["kind"] == "dynamic" else "hf_paged"
        res = gathered[i]
        row.update({k: v for k, v in res.items() if k != "index"})
        if "error" in res:
            row["status"] = "error"
        else:
            row["status"] = "ok"
            row["perplexity"] = ppl(res["nll_sum"], res["tokens"])
        rows.append(row)
    full = rows[0].get("perplexity")
    for row in rows:
        if row.get("perplexity") is not None and full is not None:
            row["relative_to_full"] = row["perplexity"] / full - 1
    unb = rows[1].get("perplexity")
    rel = relative_diff(unb, full) if unb is not None and full is not None else float("nan")
    parity = dict(compare="PagedCache unbounded vs DynamicCache (full)", relative_diff=rel,
                  tolerance=args.tolerance, ok=bool(rel <= args.tolerance))
    return dict(rows=rows, parity=parity, sink_pages=default_sink_pages(args.page_size),
                segment_comparison=segment_comparison(rows, args.tolerance),
                paired_intervals=paired_intervals(rows, args.block))


BASELINE = "fifo+sinks"  # what the other policies are compared with, segment by segment


def compared_pairs(rows: list[dict]):
    """(row, reference) for each bounded row: the `BASELINE` row of its budget, or, for the baseline itself,
    the full cache (rows without a reference are left out)."""
    full = next((row for row in rows if row["policy"] == "full"), None)
    baselines = {row["budget"]: row for row in rows if row["policy"] == BASELINE}
    for row in rows:
        ref = full if row["policy"] == BASELINE else baselines.get(row["budget"])
        if row["budget"] is not None and ref is not None:
            yield row, ref


def segment_comparison(rows: list[dict], tolerance: float) -> list[dict]:
    """Segment by segment, each bounded row against its reference (`compared_pairs`). -> one entry per compared
    row: how many segments its perplexity is ``lower``, ``higher`` or ``equal`` within the relative
    ``tolerance`` (segments scored before either evicts: the policies that observe attention differ from the
    others there by float rounding); rows without segments (errors) are left out."""
    def segments(row):
        return [seg["perplexity"] for seg in row.get("segments", ())]

    out = []
    for row, ref in compared_pairs(rows):
        mine, theirs = segments(row), segments(ref)
        if not mine or len(mine) != len(theirs):
            continue
        differ = [(a, b) for a, b in zip(mine, theirs) if not math.isclose(a, b, rel_tol=tolerance)]
        lower = sum(a < b for a, b in differ)
        out.append(dict(policy=row["policy"], budget=row["budget"], reference=ref["policy"], lower=lower,
                        higher=len(differ) - lower, equal=len(mine) - len(differ), segments=len(mine)))
    return out


def paired_intervals(rows: list[dict], block: int, confidence: float = 0.95, resamples: int = 9999) -> list[dict]:
    """Each bounded row's perplexity relative to its reference's (`compared_pairs`), ``ratio`` = ppl / ppl_ref - 1,
    with a paired bootstrap interval (scipy, BCa, seeded): the text's blocks of ``block`` tokens are resampled, each
    with both rows' NLL, so that what one text happens to reward is told from a difference that holds across it.
    ``low == high == ratio == 0`` when no block differs (nothing evicted yet); rows without ``block_nll`` (errors,
    runs before it was recorded) are left out."""
    out = []
    for row, ref in compared_pairs(rows):
        if not row.get("block_nll") or len(row["block_nll"]) != len(ref.get("block_nll") or ()):
            continue
        value, low, high = relative_perplexity(row["block_nll"], ref["block_nll"], row["tokens"], block, confidence,
                                               resamples)
        out.append(dict(policy=row["policy"], budget=row["budget"], reference=ref["policy"], ratio=value, low=low,
                        high=high, confidence=confidence, blocks=len(row["block_nll"]), block=block))
    return out


def relative_perplexity(block_nll, ref_block_nll, tokens: int, block: int, confidence: float = 0.95,
                        resamples: int = 9999) -> tuple[float, float, float]:
    """``(ratio, low, high)``: perplexity / reference perplexity - 1 of two scorings of the same ``tokens`` tokens,
    given as NLL sums per block of ``block`` tokens (the last one may be shorter), and its paired bootstrap
    interval (scipy, BCa, seeded); ``low == high == ratio`` when the blocks' differences are all alike."""
    from scipy.stats import bootstrap

    def ratio(diff, tokens, axis=-1):
        return np.expm1(diff.sum(axis=axis) / tokens.sum(axis=axis))

    diff = np.subtract(block_nll, ref_block_nll)
    counts = np.minimum(block, tokens - block * np.arange(len(diff))).astype(np.float64)
    value = float(ratio(diff, counts))
    if not np.ptp(diff / counts) > 0:
        return value, value, value
    interval = bootstrap((diff, counts), ratio, paired=True, vectorized=True, confidence_level=confidence,
                         n_resamples=resamples, method="BCa", rng=np.random.default_rng(0)).confidence_interval
    return value, float(interval.low), float(interval.high)


def _tokens_held(cache) -> int:
    if isinstance(cache, hf_paged.PagedCache):
        return cache.stats()["tokens_held"]
    layer = cache.layers[0]
    return int(layer.keys.shape[-2]) if getattr(layer, "keys", None) is not None else 0


# ---------------------------------------------------------------------------------------- output
def _fmt(x, digits=4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(report: dict) -> str:
    s, r = report["settings"], report["result"]
    text = report["text"]
    lines = [f"# Perplexity ({s['mode']}): {s['model']}, {text['tokens']} tokens of {text['source']}", ""]
    if s.get("quick"):
        lines += ["**Smoke test (`--quick`): a short text and small budgets, to check that everything runs; "
                  "these numbers are not results.**", ""]
    if s["mode"] == "strided":
        lines += [f"Window {s['window']}, stride {s['stride']} ({len(r['windows'])} windows, a fresh cache per "
                  f"window), page size {s['page_size']}, {s['dtype']}, {s['num_processes']} process(es).", "",
                  "| cache | attention | perplexity | NLL tokens | wall s |", "|---|---|---:|---:|---:|"]
        for row in r["rows"]:
            lines.append(f"| {row['cache']} | {row['attn_implementation']} | {_fmt(row['perplexity'])} | "
                         f"{row['tokens']} | {row['wall_s']:.1f} |")
    else:
        lines += [f"Chunks of {s['chunk']} tokens through one cache, page size {s['page_size']}, budgets in tokens "
                  f"(max_pages = budget // page size), sinks = {r['sink_pages']} page(s), {s['dtype']}, "
                  f"{s['num_processes']} process(es).", "",
                  "| cache | policy | budget | max_pages | perplexity | vs full | evictions | tokens held | wall s |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for row in r["rows"]:
            budget = "—" if row["budget"] is None else str(row["budget"])
            pages = "—" if row["max_pages"] is None else str(row["max_pages"])
            if row["status"] == "ok":
                value = _fmt(row["perplexity"])
                rel = row.get("relative_to_full", 0.0)
                vs = "—" if row["name"] == "full" else (f"{rel:+.2e}" if abs(rel) < 1e-3 else f"{100 * rel:+.1f}%")
                ev = str(row["stats"]["evictions"]) if "stats" in row else "—"
                held, wall = str(row["tokens_held"]), f"{row['wall_s']:.1f}"
            else:
                value = f"error: {row['error']}"
                vs = ev = held = wall = "—"
            lines.append(f"| {row['cache']} | {row['policy']} | {budget} | {pages} | {value} | {vs} | {ev} | "
                         f"{held} | {wall} |")
    p = r["parity"]
    lines += ["", f"Parity, {p['compare']}: relative difference {p['relative_diff']:.3e} "
                  f"(tolerance {p['tolerance']:g}): {'OK' if p['ok'] else 'MISMATCH'}."]
    if r.get("segment_comparison"):
        lines += ["", *segment_table(r["segment_comparison"], s["segment"], s["tolerance"])]
    if r.get("paired_intervals"):
        lines += ["", *interval_table(r["paired_intervals"])]
    return "\n".join(lines) + "\n"


def budget_table(entries: list[dict], cell) -> list[str]:
    """Compared rows (`compared_pairs`) as a markdown table: a row per budget, a column per compared policy
    (``policy vs reference``), ``cell(entry)`` in each cell ("—" where a policy has no entry)."""
    columns = list(dict.fromkeys((c["policy"], c["reference"]) for c in entries))
    cells = {(c["budget"], c["policy"]): cell(c) for c in entries}
    lines = ["| budget | " + " | ".join(f"{policy} vs {ref}" for policy, ref in columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    for budget in dict.fromkeys(c["budget"] for c in entries):
        lines.append(f"| {budget} | " + " | ".join(cells.get((budget, policy), "—") for policy, _ in columns) + " |")
    return lines


def segment_table(comparison: list[dict], segment: int, tolerance: float) -> list[str]:
    """`segment_comparison` as markdown (`budget_table`) under what it counts."""
    n = max(c["segments"] for c in comparison)
    return [f"Per segment of {segment} tokens ({n} segments): how many segments a policy's perplexity is lower / "
            f"higher than the reference's / equal within the tolerance {tolerance:g} (scored before either evicts). "
            f"The reference is {BASELINE} at the same budget, and for {BASELINE} the full cache.", "",
            *budget_table(comparison, lambda c: f"{c['lower']} / {c['higher']} / {c['equal']}")]


def interval_table(intervals: list[dict]) -> list[str]:
    """`paired_intervals` as markdown (`budget_table`) under what they are."""
    first = intervals[0]
    return [f"Perplexity relative to the reference's, with a {100 * first['confidence']:g}% paired bootstrap interval "
            f"over the text's {first['blocks']} blocks of {first['block']} tokens: an interval that excludes 0 is a "
            "difference that holds across the text, not a few blocks' doing.", "",
            *budget_table(intervals, lambda c: f"{100 * c['ratio']:+.2f}% [{100 * c['low']:+.2f}, "
                                               f"{100 * c['high']:+.2f}]")]


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, r = report["settings"], report["result"]
    fig, ax = plt.subplots(figsize=(8, 5))
    if s["mode"] == "strided":
        starts = [w["begin"] for w in r["windows"]]
        for kind, style in (("dynamic", "-o"), ("paged", "--x")):
            ax.plot(starts, [ppl(w[f"{kind}_nll_sum"], w["tokens"]) for w in r["windows"]], style, ms=4,
                    label=f"{'DynamicCache' if kind == 'dynamic' else 'PagedCache'}")
        ax.set_xlabel("window start (token)")
        ax.set_ylabel("perplexity of the window's scored tokens")
        ax.set_title(f"Strided perplexity: window {s['window']}, stride {s['stride']}")
    else:
        rows = r["rows"]
        full, unb = rows[0], rows[1]
        if full["status"] == unb["status"] == "ok" and r["parity"]["ok"]:  # one line, said to be both
            ax.axhline(full["perplexity"], color="black", lw=1.5,
                       label=f"full cache: DynamicCache = PagedCache unbounded ({full['perplexity']:.3f}, "
                             f"rel. diff {r['parity']['relative_diff']:.0e})")
        else:
            for row, style in ((full, "-"), (unb, ":")):
                if row["status"] == "ok":
                    ax.axhline(row["perplexity"], color="black", lw=1.5, ls=style,
                               label=f"{row['label']} ({row['perplexity']:.3f})")
        legend = {"score": "score (default)", "lru": "lru", "fifo+sinks": f"fifo + {r['sink_pages']} sink page(s)", "fifo": "fifo, no sinks"}
        styles = {"score": dict(marker="D", ls="-", color="tab:red"), "lru": dict(marker="o", ls="-", color="tab:blue"),
                  "fifo+sinks": dict(marker="s", ls="--", color="tab:orange"),
                  "fifo": dict(marker="^", ls=":", color="tab:green")}
        curves = {}
        for i, policy in enumerate(POLICIES):
            pts = [(row["budget"], row["perplexity"]) for row in rows if row["policy"] == policy and row["status"] == "ok"]
            if pts:  # nudged sideways so that lines that coincide stay visible
                curves[policy] = dict(pts)
                ax.plot([b * 2 ** (0.04 * (i - 1)) for b, _ in pts], [y for _, y in pts], ms=7, label=legend[policy],
                        **styles[policy])
        ax.set_xscale("log", base=2)
        ax.set_xticks(s["budgets"], [str(b) for b in s["budgets"]])
        ax.set_xlim(min(s["budgets"]) / 1.3, max(s["budgets"]) * 1.3)
        ax.set_xlabel("KV budget (tokens)")
        ax.set_ylabel("perplexity")
        ax.set_title(("SMOKE TEST, not a result: " if s.get("quick") else "")
                     + f"Streaming perplexity, {report['text']['tokens']} tokens, chunk {s['chunk']}")
        ys = [row["perplexity"] for row in rows if row["status"] == "ok"]
        if ys and max(ys) > 8 * min(ys):
            ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finite(obj):
    """NaN / inf -> None, so that perplexity.json is strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "platform": platform.platform(), "hf_paged": hf_paged.__version__}
    for name in ("torch", "transformers", "tokenizers", "datasets", "accelerate", "matplotlib"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


# ------------------------------------------------------------------------------------------ main
def write_outputs(report: dict, out: Path) -> str:
    """perplexity.md, .json and .png of ``report`` in ``out``; -> the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(report)
    (out / "perplexity.md").write_text(table, encoding="utf-8")
    (out / "perplexity.json").write_text(json.dumps(_finite(report), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    plot(report, out / "perplexity.png")
    return table


def replot(path: str, out: Path) -> int:
    """Rewrite the outputs of an earlier run (its segment comparison and intervals recomputed from its rows; a run
    made before blocks were recorded has no intervals)."""
    report = json.loads(Path(path).read_text(encoding="utf-8"))
    settings, result = report["settings"], report["result"]
    if settings["mode"] == "streaming":
        result["segment_comparison"] = segment_comparison(result["rows"], settings["tolerance"])
        if "block" in settings:
            result["paired_intervals"] = paired_intervals(result["rows"], settings["block"])
    print(write_outputs(report, out))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    missing = [name for name in ("matplotlib", "scipy") if importlib.util.find_spec(name) is None]
    if missing:  # (the plot and the intervals come last: say so before the run, not after it)
        raise SystemExit(f"perplexity.py needs {' and '.join(missing)}: pip install \".[eval]\"")
    if args.replot:
        return replot(args.replot, Path(args.out))
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    from hf_paged.distributed import make_state

    state = make_state(cpu=True if args.cpu else None)
    quiet = args.no_progress or not state.is_main_process

    def progress(**kw):
        return tqdm(disable=quiet, dynamic_ncols=True, **kw)

    t0 = time.perf_counter()
    with state.main_process_first():  # the first process converts / downloads, the others read the cache
        models, tokenizer = {}, None
        for kind, attn in (("dynamic", "sdpa"), ("paged", hf_paged.ATTN_IMPLEMENTATION)):
            models[kind], tokenizer = assets.load_model_and_tokenizer(
                args.model, dtype=assets.DTYPES[args.dtype], device=state.device, attn_implementation=attn)
        ids, text_info = load_token_ids(args, tokenizer)
    if len(ids) < 2:
        raise SystemExit(f"the text has {len(ids)} token(s): nothing to score")
    run = run_strided if args.mode == "strided" else run_streaming
    result = run(args, state, models, ids, progress)
    settings = {k: v for k, v in vars(args).items() if k not in ("no_progress",)}
    settings.update(num_processes=state.num_processes, device=str(state.device),
                    torch_threads=torch.get_num_threads())
    report = dict(settings=settings, text=text_info, result=result, versions=versions(),
                  wall_s=time.perf_counter() - t0)
    failed = not result["parity"]["ok"] or any(row.get("status") == "error" for row in result["rows"])
    if state.is_main_process:
        out = Path(args.out)
        print(write_outputs(report, out))
        print(f"wrote {out / 'perplexity.md'}, {out / 'perplexity.json'}, {out / 'perplexity.png'}")
    state.wait_for_everyone()
    if state.use_distributed:
        state.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
