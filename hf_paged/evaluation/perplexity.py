"""Perplexity of a causal LM with DynamicCache vs PagedCache, unbounded and under eviction policies (the study
behind scripts/perplexity.py, whose docstring lists its arguments and examples).

``strided`` (the transformers perplexity guide): windows of ``window`` tokens every ``stride`` tokens, the overlap
masked out of the labels (-100); every window is a fresh cache and a ``use_cache=True`` forward, so the cache is
really written and read. DynamicCache + "sdpa" and PagedCache + "hf_paged" must agree within ``tolerance``.

``streaming`` (StreamingLLM's long-text evaluation): the text goes through ONE cache in chunks (`CacheStream`),
every next token scored given what the cache still holds. Rows: DynamicCache (full), PagedCache unbounded (must
equal full within ``tolerance``), and for every budget B (tokens, ``max_pages = B // page_size``): ``score`` (the
default), ``lru``, ``fifo+sinks`` (``sink_pages`` = enough pages for 4 tokens) and ``fifo`` without sinks. Per
segment of ``segment`` tokens, each policy's perplexity is compared with fifo+sinks' at the same budget (and
fifo+sinks' with the full cache's), and each policy's perplexity relative to that reference gets a paired
bootstrap interval over blocks of ``block`` tokens.

Several processes (``accelerate launch`` / ``torchrun``) split the strided windows, or the streaming cache
configurations, with ``PartialState.split_between_processes``; NLL sums and token counts come back through
``accelerate.utils.gather_object`` and are added in a fixed order, so the numbers do not depend on the number of
processes. Only the main process writes perplexity.md, .json and .png.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

import hf_paged

from .. import assets
from ..eviction import default_sink_pages
from .caches import StudyStore, make_cache, store_text, tokens_held
from .formats import pyplot, write_report
from .intervals import paired_ratio_interval
from .nll import CacheStream, token_nll
from .nll import perplexity as ppl
from .run_info import versions
from .text import load_token_ids

POLICIES = ("score", "lru", "fifo+sinks", "fifo")
PER_HEAD = "score+heads"  # "score" per KV head (PagedCache(per_head_eviction=True), page size 1): with --per-head
# What the stored 2048-token study is made of (docs/perplexity.md), and what --quick shortens it to.
DEFAULTS = dict(max_tokens=2048, budgets="128,256,512,1024")
QUICK = dict(max_tokens=256, budgets="64,128")


# ---------------------------------------------------------------------------------------- numbers
def relative_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else float("inf")


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


def run_strided(args, state, models, ids, progress, store: StudyStore) -> dict:
    from accelerate.utils import gather_object

    from ..distributed import deal

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
                cache = make_cache(kind, model, args.page_size, store, kv_format=args.kv_format)
                nll, count = window_nll(model, cache, ids, begin, end, trg, state.device)
                if kind == "paged":
                    store.add(cache)
                rec[f"{kind}_nll_sum"], rec["tokens"] = nll, count
                rec[f"{kind}_wall_s"] = time.perf_counter() - t0
            records.append(rec)
            bar.update(1)
        bar.close()
    records = sorted(gather_object(records), key=lambda r: r["index"])
    tokens = sum(r["tokens"] for r in records)
    rows = []
    fmt = "" if args.kv_format == "float" else f", kv_format={args.kv_format!r}"
    for kind, label, cache_name, attn in (("dynamic", "DynamicCache", "DynamicCache", "sdpa"),
                                         ("paged", "PagedCache", f"PagedCache(page_size={args.page_size}{fmt})",
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
              "fifo": dict(eviction="fifo", sink_pages=0),
              PER_HEAD: dict(eviction="score", sink_pages=sinks, per_head_eviction=True)}
    if args.lru_threshold is not None:
        kwargs["lru"]["lru_threshold"] = args.lru_threshold
    for budget in args.budgets:
        for policy in POLICIES + ((PER_HEAD,) if getattr(args, "per_head", False) else ()):
            configs.append(dict(name=f"{policy}@{budget}", label=f"PagedCache {policy}", kind="paged", policy=policy,
                                budget=budget, max_pages=budget // args.page_size, policy_kwargs=kwargs[policy]))
    return configs


def run_streaming(args, state, models, ids, progress, store: StudyStore) -> dict:
    from accelerate.utils import gather_object

    from ..distributed import deal

    configs = streaming_configs(args)
    results = []
    with state.split_between_processes(deal(list(enumerate(configs)), state.num_processes)) as mine:  # round-robin
        for idx, cfg in mine:
            res = dict(index=idx, rank=state.process_index)
            bar = progress(total=len(ids) - 1, desc=f"{cfg['name']} (rank {state.process_index})")
            t0 = time.perf_counter()
            try:
                model = models[cfg["kind"]]
                paged = cfg["kind"] == "paged"
                paged_kwargs = (dict(max_pages=cfg["max_pages"], kv_format=args.kv_format, **cfg["policy_kwargs"])
                                if paged else {})
                cache = make_cache(cfg["kind"], model, args.page_size, store, **paged_kwargs)
                nll = CacheStream(model, cache, hf_paged.CACHE_KWARG).score(ids[None], args.chunk, bar)[0]
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
                    store.add(cache)
                    res["stats"] = cache.stats()
                res["tokens_held"] = tokens_held(cache)
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
    with a paired bootstrap interval over the text's blocks of ``block`` tokens (`paired_ratio_interval`), so that
    what one text happens to reward is told from a difference that holds across it. ``low == high == ratio == 0``
    when no block differs (nothing evicted yet); rows without ``block_nll`` (errors, runs before it was recorded)
    are left out."""
    out = []
    for row, ref in compared_pairs(rows):
        if not row.get("block_nll") or len(row["block_nll"]) != len(ref.get("block_nll") or ()):
            continue
        blocks = len(row["block_nll"])
        tokens = np.minimum(block, row["tokens"] - block * np.arange(blocks))
        value, low, high = paired_ratio_interval(row["block_nll"], ref["block_nll"], tokens, confidence, resamples)
        out.append(dict(policy=row["policy"], budget=row["budget"], reference=ref["policy"], ratio=value, low=low,
                        high=high, confidence=confidence, blocks=blocks, block=block))
    return out


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
    for rank, totals in enumerate(r.get("prefix_store") or []):
        lines += ["", f"Prefix store of the PagedCaches (rank {rank}) {store_text(totals)}."]
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
    plt = pyplot()
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
        legend = {"score": "score (default)", "lru": "lru", "fifo+sinks": f"fifo + {r['sink_pages']} sink page(s)",
                  "fifo": "fifo, no sinks", PER_HEAD: "score per KV head"}
        styles = {"score": dict(marker="D", ls="-", color="tab:red"), "lru": dict(marker="o", ls="-", color="tab:blue"),
                  "fifo+sinks": dict(marker="s", ls="--", color="tab:orange"),
                  "fifo": dict(marker="^", ls=":", color="tab:green"),
                  PER_HEAD: dict(marker="v", ls="-", color="tab:purple")}
        curves = {}
        for i, policy in enumerate((*POLICIES, PER_HEAD)):
            pts = [(row["budget"], row["perplexity"]) for row in rows
                   if row["policy"] == policy and row["status"] == "ok"]
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


# ------------------------------------------------------------------------------------------ main
def write_outputs(report: dict, out: Path) -> str:
    """perplexity.md, .json and .png of ``report`` in ``out``; -> the markdown."""
    table = markdown(report)
    write_report(out, "perplexity", table, report, lambda path: plot(report, path), indent=2)
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


def main(args) -> int:
    """Run the study of ``args`` (scripts/perplexity.py's arguments) and write its outputs on the main process, or
    only rewrite them with ``args.replot``. -> exit status: 1 when a parity check failed or a row raised."""
    missing = [name for name in ("matplotlib", "scipy") if importlib.util.find_spec(name) is None]
    if missing:  # (the plot and the intervals come last: say so before the run, not after it)
        raise SystemExit(f"perplexity.py needs {' and '.join(missing)}: pip install \".[eval]\"")
    if args.replot:
        return replot(args.replot, Path(args.out))
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm.auto import tqdm

    from ..distributed import make_state

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
        ids, text_info = load_token_ids(tokenizer, args.max_tokens, args.dataset, args.config, args.split,
                                        args.column, args.text_file)
    if len(ids) < 2:
        raise SystemExit(f"the text has {len(ids)} token(s): nothing to score")
    run = run_strided if args.mode == "strided" else run_streaming
    store = StudyStore(args.prefix_store)  # (each process opens it)
    result = run(args, state, models, ids, progress, store)
    if store.store is not None:
        from accelerate.utils import gather_object

        result["prefix_store"] = gather_object([store.close(f"perplexity (rank {state.process_index})")])
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
