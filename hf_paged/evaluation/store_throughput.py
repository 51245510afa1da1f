"""`generate_many` throughput with a shared system prompt across processes under ``torchrun``, with and without a
shared prefix store (issue 33; ``scripts/prefix_store.py --parts torchrun``).

Every launch is ``torchrun --standalone --nproc_per_node P`` (CPU, gloo, ``--rank-threads`` torch threads a process)
of this module: each process loads the model and calls `hf_paged.distributed.generate_distributed` on the same
``--prompts`` prompts, each the first ``--system-tokens`` tokens of the Britannica article (a shared system prompt)
followed by an excerpt of it; greedy, ``--new-tokens`` new tokens each. The modes are those of the time-to-first-token
study (`hf_paged.evaluation.prefix_store.MODES`): no store; an empty folder / Redis store both processes share
(``cold``: the processes compute and write, and may load what the other wrote); and that store again in a new launch
(``warm``: a restart). Rounds rotate the order of the modes.

Per launch: the new tokens per second of wall time from the first process's start of generation to the last one's
end (model loading excluded), the CPU seconds of both processes in that call, their summed store counters, pool
prefix hits and load decisions, and the completions (which must equal the no-store launch's).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .formats import mib, write_report
from .prefix_store import MODES, rotated_rounds
from .run_info import load_average, versions

COUNTERS = ("store_hits", "store_misses", "store_pages_read", "store_pages_written", "store_bytes_read",
            "store_bytes_written", "store_load_seconds", "store_recomputed", "prefix_hits")
COLORS = {"none": "grey", "disk": "tab:blue", "redis": "tab:red"}  # a mode's bar, by its store


def shared_prompts(tokenizer, num_prompts: int, system_tokens: int) -> list[str]:
    """``num_prompts`` prompts: the article's first ``system_tokens`` tokens (as text), a blank line, an excerpt."""
    from hf_paged import assets
    from hf_paged.evaluation.text import load_token_ids

    ids, _ = load_token_ids(tokenizer, system_tokens)
    system = tokenizer.decode(ids)
    return [f"{system}\n\n{excerpt}" for excerpt in assets.britannica_prompts(num_prompts, 20, 60, seed=1)]


def shared_prefix_tokens(tokenizer, prompts: list[str]) -> int:
    """Leading tokens every prompt has in common (what prefix caching and a store can share)."""
    rows = tokenizer(prompts)["input_ids"]
    common = 0
    while common < min(map(len, rows)) and len({row[common] for row in rows}) == 1:
        common += 1
    return common


def rank_main(argv: list[str]) -> None:
    """One launched process: ``MODEL URI THREADS PROMPTS SYSTEM_TOKENS NEW_TOKENS OUT_JSON`` (URI "" = no store);
    the main process writes the launch's JSON."""
    import torch
    from accelerate.utils import gather_object

    import hf_paged
    from hf_paged import assets
    from hf_paged.distributed import generate_distributed, make_state

    model_name, uri, threads, num_prompts, system_tokens, new_tokens, out = argv
    torch.set_num_threads(int(threads))
    state = make_state(cpu=True)
    model, tokenizer = assets.load_model_and_tokenizer(model_name, attn_implementation=hf_paged.ATTN_IMPLEMENTATION)
    prompts = shared_prompts(tokenizer, int(num_prompts), int(system_tokens))
    cpu = time.process_time()
    result = generate_distributed(model, tokenizer, prompts, max_new_tokens=int(new_tokens), state=state,
                                  progress=False, prefix_store=uri or None)
    cpu = gather_object([time.process_time() - cpu])
    if state.is_main_process:
        Path(out).write_text(json.dumps(dict(
            summary=result.summary, cpu_s=cpu, shared_prefix_tokens=shared_prefix_tokens(tokenizer, prompts),
            completions=[r["completion"] for r in result.results])), encoding="utf-8")
    state.wait_for_everyone()
    state.destroy_process_group()


def launch(args, uri: str) -> dict:
    """One ``torchrun`` launch of `rank_main`; its figures (see the module docstring)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(args.rank_threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="hf_paged-torchrun-") as tmp:
        out = Path(tmp) / "launch.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(args.processes), "-m", __name__, args.model, uri, str(args.rank_threads), str(args.prompts),
                   str(args.system_tokens), str(args.new_tokens), str(out)]
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"a torchrun launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        data = json.loads(out.read_text(encoding="utf-8"))
    ranks = data["summary"]["ranks"]
    counters = {key: sum(r["kv"].get(key, 0) for r in ranks) for key in COUNTERS}
    return dict(tokens_per_s=data["summary"]["total"]["tokens_per_s"], seconds=data["summary"]["total"]["seconds"],
                new_tokens=data["summary"]["total"]["new_tokens"], cpu_s=sum(data["cpu_s"]),
                launch_s=time.perf_counter() - started, shared_prefix_tokens=data["shared_prefix_tokens"],
                decisions=sorted({str(r["kv"].get("store_decision")) for r in ranks}),
                completions=data["completions"], **counters)


def summarize(runs: dict) -> dict:
    """Medians per mode over rounds; each mode's throughput and CPU cost against the same round's no-store launch
    (median of the rounds' ratios); the store hit rate (pages the pools missed that the store supplied)."""
    out = {}
    for mode, rows in runs.items():
        med = {key: statistics.median(r[key] for r in rows) for key in ("tokens_per_s", "seconds", "cpu_s",
                                                                          "launch_s", *COUNTERS)}
        looked_up = med["store_hits"] + med["store_misses"]
        out[mode] = dict(
            med, speedup=statistics.median(r["tokens_per_s"] / n["tokens_per_s"] for n, r in zip(runs["none"], rows)),
            cpu_ratio=statistics.median(n["cpu_s"] / r["cpu_s"] for n, r in zip(runs["none"], rows)),
            hit_rate=med["store_hits"] / looked_up if looked_up else None,
            spread=(max(r["tokens_per_s"] for r in rows) - min(r["tokens_per_s"] for r in rows)) / med["tokens_per_s"],
            decisions=sorted({d for r in rows for d in r["decisions"]}),
            same_completions=all(r["completions"] == n["completions"] for n, r in zip(runs["none"], rows)))
    return out


def markdown_report(result: dict) -> str:
    modes = result["modes"]
    lines = ["# generate_many across processes with a shared prefix store", "",
             f"Model {result['model']}: {result['prompts']} prompts, each a shared {result['system_tokens']}-token "
             f"system prompt (the article's start; {result['shared_prefix_tokens']} leading tokens shared after "
             f"tokenization) and an excerpt, {result['new_tokens']} new tokens each, greedy; `torchrun "
             f"--nproc_per_node {result['processes']}` (CPU, gloo, {result['rank_threads']} torch thread a process), "
             f"a new launch per run, {result['repeats']} rounds in a rotated order. Load average "
             f"{result['load_before']} before, {result['load_after']} after.", "",
             "| mode | new tokens/s (median) | spread | x none (median of rounds) | CPU s, all processes | "
             "less CPU than none | store hit rate | pages read / written | MiB read / written | load s | "
             "loads skipped | pool prefix hits | same completions |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, m in modes.items():
        hit_rate = "-" if m["hit_rate"] is None else f"{100 * m['hit_rate']:.0f}%"
        lines.append(
            f"| {mode} | {m['tokens_per_s']:.1f} | {m['spread']:.0%} | {m['speedup']:.2f}x | {m['cpu_s']:.1f} | "
            f"{m['cpu_ratio']:.2f}x | "
            f"{hit_rate} ({m['store_hits']:.0f} of {m['store_hits'] + m['store_misses']:.0f}) | "
            f"{m['store_pages_read']:.0f} / {m['store_pages_written']:.0f} | {mib(m['store_bytes_read'])} / "
            f"{mib(m['store_bytes_written'])} | {m['store_load_seconds']:.2f} | {m['store_recomputed']:.0f} | "
            f"{m['prefix_hits']:.0f} | {'yes' if m['same_completions'] else 'NO'} |")
    lines += ["", "Hit rate: pages a process's pool missed that the store supplied, of all pages it looked up "
              "there (summed over processes; `warm` = after a restart). Spread: (max - min) / median of a mode's "
              "tokens/s over rounds (wall time follows the machine's load; CPU seconds much less). Load decisions: "
              + "; ".join(f"{mode}: {', '.join(m['decisions'])}" for mode, m in modes.items() if mode != "none")
              + "."]
    return "\n".join(lines) + "\n"


def plot(result: dict):
    def draw(path):
        from .formats import pyplot
        plt = pyplot()
        modes = result["modes"]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, key, ratio, label in zip(axes, ("tokens_per_s", "cpu_s"), ("speedup", "cpu_ratio"),
                                         ("new tokens / s (wall)", "CPU seconds, all processes")):
            bars = ax.bar(range(len(modes)), [m[key] for m in modes.values()],
                          color=[COLORS[mode.split()[0]] for mode in modes])
            for bar, m in zip(bars, modes.values()):
                hits = "" if m["hit_rate"] is None else f"\n{100 * m['hit_rate']:.0f}% hits"
                ax.annotate(f"{m[ratio]:.2f}x{hits}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center", va="bottom", fontsize=8)
            ax.set_ylim(0, 1.2 * max(m[key] for m in modes.values()))  # (room for the labels)
            ax.set_xticks(range(len(modes)), list(modes), fontsize=8)
            ax.set_ylabel(label)
        axes[0].set_title(f"{result['processes']} torchrun processes, {result['prompts']} prompts, shared "
                          f"{result['system_tokens']}-token prefix", fontsize=9)
        axes[1].set_title(f"median of {result['repeats']} rounds; x: against no store; load {result['load_before'][0]}",
                          fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
    return draw


def main(args, server, folder: Path, tqdm) -> dict:
    """``args.repeats`` rounds of launches in every mode; torchrun.md / .json / .png in ``--out``."""
    result = dict(model=args.model, prompts=args.prompts, system_tokens=args.system_tokens,
                  new_tokens=args.new_tokens, processes=args.processes, rank_threads=args.rank_threads,
                  repeats=args.repeats, load_before=load_average(), versions=versions())
    bar = tqdm(total=args.repeats * len(MODES), desc="torchrun launches", disable=args.no_progress)
    runs = rotated_rounds(args.repeats, lambda uri: launch(args, uri), server, folder, bar)
    result.update(load_after=load_average(), modes=summarize(runs),
                  shared_prefix_tokens=runs["none"][0]["shared_prefix_tokens"],
                  runs={mode: [{k: v for k, v in r.items() if k != "completions"} for r in rows]
                        for mode, rows in runs.items()})
    markdown = markdown_report(result)
    write_report(Path(args.out), "torchrun", markdown, result, plot(result))
    print(markdown)
    return result


if __name__ == "__main__":
    rank_main(sys.argv[1:])
