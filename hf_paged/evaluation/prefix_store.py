"""Time to first token of a long prompt in a fresh process: computed, or loaded from a prefix store (issue 33).

Every run is a new Python process (`child`): it loads the model, tokenizes the first ``tokens`` tokens of the
text, and times ``model.generate(max_new_tokens=1)`` with a ``PagedCache(model=model, prefix_store=...)``:
wall and CPU seconds of that call (the hash root, the weights digest, the store lookup and loading included),
its first token and the store counters. Modes, one process each and in a rotated order every round:

- ``none``: no store (everything computed);
- ``disk cold`` / ``redis cold``: an empty store (a new folder; a flushed server): computed, then written;
- ``disk warm`` / ``redis warm``: the store the cold run of the same round filled: pages loaded.

The Redis server is a `LocalRedisServer` on this machine (``allkeys-lru``, 2 GB). The report gives medians
over rounds per length and mode, each warm mode's per-round ratio to ``none`` (median), whether every run's
first token is the same, the store figures and the load average before and after.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from .formats import mib, write_report
from .run_info import load_average, versions

MODES = ("none", "disk cold", "disk warm", "redis cold", "redis warm")
GROUPS = (("none",), ("disk cold", "disk warm"), ("redis cold", "redis warm"))  # a warm run follows its cold one

CHILD = """
import json, sys, time
import torch
import hf_paged
from hf_paged import assets
from hf_paged.evaluation.text import load_token_ids
model_name, tokens, uri, threads, page_size = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \\
    int(sys.argv[5])
torch.set_num_threads(threads)
model, tokenizer = assets.load_model_and_tokenizer(model_name, attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
ids, _ = load_token_ids(tokenizer, tokens)
cache = hf_paged.PagedCache(page_size=page_size, model=model, prefix_store=uri or None)
wall, cpu = time.perf_counter(), time.process_time()
out = model.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=1,
                     do_sample=False, **{hf_paged.CACHE_KWARG: cache})
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
stats = cache.stats()
if cache.prefix_store is not None:
    cache.prefix_store.flush()
    stats = cache.stats()
print(json.dumps(dict(ttft_s=wall, ttft_cpu_s=cpu, token=int(out[0, -1]), prompt_tokens=len(ids),
                      **{k: v for k, v in stats.items() if k.startswith("store_")})))
"""


def run_child(args, tokens: int, uri: str) -> dict:
    """One fresh process (see the module docstring); its JSON line."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), args.model, str(tokens), uri,
                             str(args.threads), str(args.page_size)], capture_output=True, text=True, env=env,
                            timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"a measured process failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def store_uri(mode: str, server, folder: Path) -> str:
    """The store a mode's run is given ("" for ``none``); a cold mode empties its store first."""
    import redis

    if mode == "none":
        return ""
    if mode.startswith("disk"):
        if mode == "disk cold":
            shutil.rmtree(folder, ignore_errors=True)
        return str(folder)
    if mode == "redis cold":
        redis.Redis.from_url(server.url).flushdb()
    return server.url


def rotated_rounds(repeats: int, run, server, folder: Path, bar) -> dict:
    """``repeats`` rounds of ``run(uri)`` for every mode, the groups' order rotated every round (a warm run right
    after its cold one): per mode, the runs' results in round order. ``bar`` (tqdm) advances once a run."""
    runs = {mode: [] for mode in MODES}
    for round_ in range(repeats):
        shift = round_ % len(GROUPS)
        for group in GROUPS[shift:] + GROUPS[:shift]:
            for mode in group:
                runs[mode].append(run(store_uri(mode, server, folder)))
                bar.update()
    bar.close()
    return runs


def measure_length(args, tokens: int, server, folder: Path, tqdm) -> dict:
    """``args.repeats`` rounds of every mode for a prompt of ``tokens`` tokens."""
    bar = tqdm(total=args.repeats * len(MODES), desc=f"{tokens} tokens", disable=args.no_progress)
    return rotated_rounds(args.repeats, lambda uri: run_child(args, tokens, uri), server, folder, bar)


def summarize(runs: dict) -> dict:
    """Medians per mode, the median over rounds of ``none``'s wall (and CPU) time over each mode's, and the first
    tokens' agreement."""
    out = {}
    for mode, rows in runs.items():
        ratios = [n["ttft_s"] / r["ttft_s"] for n, r in zip(runs["none"], rows)]
        cpu_ratios = [n["ttft_cpu_s"] / r["ttft_cpu_s"] for n, r in zip(runs["none"], rows)]
        out[mode] = dict(
            ttft_s=statistics.median(r["ttft_s"] for r in rows),
            ttft_cpu_s=statistics.median(r["ttft_cpu_s"] for r in rows),
            speedup=statistics.median(ratios),
            cpu_speedup=statistics.median(cpu_ratios),
            pages_loaded=statistics.median(r.get("store_pages_read", 0) for r in rows),
            pages_missed=statistics.median(r.get("store_misses", 0) for r in rows),
            pages_written=statistics.median(r.get("store_pages_written", 0) for r in rows),
            bytes_read=statistics.median(r.get("store_bytes_read", 0) for r in rows),
            load_s=statistics.median(r.get("store_load_seconds", 0) for r in rows),
            decision=rows[-1].get("store_decision"),
        )
    tokens = {r["token"] for rows in runs.values() for r in rows}
    return dict(modes=out, same_first_token=len(tokens) == 1)


def markdown_report(result: dict) -> str:
    lines = ["# Time to first token from a prefix store", "",
             f"Model {result['model']}, page size {result['page_size']}, {result['threads']} torch thread(s), "
             f"{result['repeats']} rounds of fresh processes, modes in a rotated order; load average "
             f"{result['load_before']} before, {result['load_after']} after.", "",
             "| prompt tokens | mode | TTFT (s, median) | CPU s | speed-up vs none, wall / CPU (median of rounds) | "
             "pages loaded | MiB read | load s |", "|---|---|---|---|---|---|---|---|"]
    for tokens, summary in result["lengths"].items():
        for mode, m in summary["modes"].items():
            lines.append(f"| {tokens} | {mode} | {m['ttft_s']:.3f} | {m['ttft_cpu_s']:.3f} | {m['speedup']:.2f}x / "
                         f"{m['cpu_speedup']:.2f}x | "
                         f"{m['pages_loaded']:.0f} | {mib(m['bytes_read'])} | {m['load_s']:.3f} |")
    lines += ["", "Every run's first token equal: " + ", ".join(
        f"{t}: {'yes' if s['same_first_token'] else 'NO'}" for t, s in result["lengths"].items()), ""]
    decisions = {s["modes"]["disk warm"]["decision"] for s in result["lengths"].values()}
    lines.append(f"Load decisions of the warm runs: {', '.join(sorted(str(d) for d in decisions))}.")
    return "\n".join(lines) + "\n"


def plot(result: dict):
    def draw(path):
        from .formats import pyplot
        plt = pyplot()
        lengths = list(result["lengths"])
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        width = 0.8 / len(MODES)
        for ax, key, ratio, label in zip(axes, ("ttft_s", "ttft_cpu_s"), ("speedup", "cpu_speedup"),
                                         ("wall seconds", "CPU seconds")):
            for j, mode in enumerate(MODES):
                figures = [result["lengths"][t]["modes"] for t in lengths]
                bars = ax.bar([i + j * width for i in range(len(lengths))], [f[mode][key] for f in figures], width,
                              label=mode)
                for bar, f in zip(bars, figures):
                    if mode.endswith("warm"):
                        ax.annotate(f"{f[mode][ratio]:.1f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                    ha="center", va="bottom", fontsize=8)
            ax.set_xticks([i + 0.4 - width / 2 for i in range(len(lengths))], [f"{t} tokens" for t in lengths])
            ax.set_ylabel(f"time to first token, fresh process ({label})")
        axes[0].set_title(f"{result['model']}: median of {result['repeats']} rounds, load {result['load_before'][0]}")
        axes[1].set_title("x: none's time / the mode's, median of rounds")
        axes[0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return draw


def ttft_part(args, server, folder: Path, tqdm) -> dict:
    """The time-to-first-token study for every ``args.tokens`` length; prefix_store.md / .json / .png in ``--out``
    (rewritten after each length: a long run keeps what it measured)."""
    result = dict(model=args.model, page_size=args.page_size, threads=args.threads, repeats=args.repeats,
                  load_before=load_average(), versions=versions(), lengths={}, runs={})
    started = time.perf_counter()
    for tokens in args.tokens:
        runs = measure_length(args, tokens, server, folder, tqdm)
        result["runs"][str(tokens)] = runs
        result["lengths"][str(tokens)] = summarize(runs)
        result["seconds"], result["load_after"] = time.perf_counter() - started, load_average()
        write_report(Path(args.out), "prefix_store", markdown_report(result), result, plot(result))
    print(markdown_report(result))
    return result


def main(args) -> dict:
    """Every part of ``args.parts`` (``ttft``: this module; ``torchrun``: `store_throughput`) on one local Redis
    server and one folder; -> {part: result}."""
    from tqdm.auto import tqdm

    from ..prefix_store import LocalRedisServer
    from . import store_throughput

    parts = {"ttft": ttft_part, "torchrun": store_throughput.main}
    server = LocalRedisServer(maxmemory="2gb").start()
    folder = Path(tempfile.mkdtemp(prefix="hf_paged-prefix-store-"))
    try:
        return {part: parts[part](args, server, folder / "store", tqdm) for part in args.parts}
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)
