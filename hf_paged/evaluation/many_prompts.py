"""Many prompts of different lengths: `generate_many` against `generate` and transformers' continuous batching
(the study behind scripts/many_prompts.py, whose docstring describes the workload, the systems and the flags).

The workload is the same for every system and run (`workload`); the systems run alternately, the order rotated
every repeat; tokens/s over wanted tokens, CPU-seconds per pass (the process's ``time.process_time``; vLLM's
runner's own), mean time to first token, peak RSS growth (`MemoryMeter`), prefix pages reused, and whether every
prompt's tokens equal the ``dynamic`` run's. A ratio whose repeats spread by more than 20% is marked noisy.
vLLM CPU (`vllm_peer`) is a further row when its environment exists; otherwise its row reads "not run".
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

import hf_paged

from .. import assets
from .caches import StudyStore
from .formats import pyplot, write_report
from .memory import MemoryMeter
from .run_info import load_average
from .vllm_peer import VllmPeer

SYSTEMS = ("dynamic", "paged", "transformers CB", "generate_many", "generate_many packed")
COMPILED = "generate_many compiled"  # (with --compile) generate_many(compile=True), compiled before the timed passes


def workload(tokenizer, args) -> tuple[list[list[int]], list[int]]:
    """(prompts as token ids, wanted new tokens per prompt), the same for every system and run."""
    ids = tokenizer(assets.britannica_text())["input_ids"]
    system, ids = ids[:args.system_prompt], ids[args.system_prompt:]
    n = args.num_prompts
    lengths = [round(args.min_len + (args.max_len - args.min_len) * i / max(n - 1, 1)) for i in range(n)]
    random.Random(0).shuffle(lengths)
    prompts, start = [], 0
    for length in lengths:
        prompts.append(system + ids[start:start + length])
        start += length
    return prompts, [args.short_new if i % 2 == 0 else args.long_new for i in range(n)]


class FirstToken:
    """A logits processor that records when generate's first step finished (the prefill)."""

    def __init__(self):
        self.time = None

    def __call__(self, input_ids, scores):
        self.time = self.time or time.perf_counter()
        return scores


def run_generate(model, prompts, wanted, args, paged: bool):
    from transformers import LogitsProcessorList

    outputs, first_times, start = [], [], time.perf_counter()
    for b in range(0, len(prompts), args.batch_size):
        batch = prompts[b:b + args.batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        first = FirstToken()
        cache = hf_paged.PagedCache(config=model.config, kv_format=args.kv_format) if paged else None
        kwargs = {hf_paged.CACHE_KWARG: cache} if paged else {}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(wanted[b:b + len(batch)]),
                             do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([first]), **kwargs)
        first_times += [first.time - start] * len(batch)
        outputs += [row[width:width + n].tolist() for row, n in zip(out, wanted[b:b + len(batch)])]
    return outputs, first_times, time.perf_counter() - start, 0


def run_transformers_cb(model, prompts, wanted, args):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    block = ContinuousBatchingConfig().page_size  # tokens per block (256 by default)
    # enough blocks for every request at once, and no more: by default the pool takes 90% of free memory
    blocks = sum(-(-(len(p) + n) // block) for p, n in zip(prompts, wanted)) + 1
    config = ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=args.cb_max_batch_tokens)
    gen = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max(wanted))
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=config,
                                                   warmup=False) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, record_timestamps=True) for p, n in zip(prompts, wanted)]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped before finishing every request")
            if result is not None and result.is_finished():
                results[result.request_id] = result
    elapsed = time.perf_counter() - start
    outputs = [results[i].generated_tokens for i in ids]
    first_times = [results[i].timestamps[0] - start for i in ids]
    return outputs, first_times, elapsed, 0


def compiled_systems(args) -> dict[str, int]:
    """The compiled rows (with ``--compile``) and their steps' token budgets: one row per ``--compile-batch-tokens``
    value, named ``generate_many compiled`` when it is the only one and equals ``--max-batch-tokens``."""
    budgets = getattr(args, "compile_batch_tokens", None) or [args.max_batch_tokens]
    if budgets == [args.max_batch_tokens]:
        return {COMPILED: args.max_batch_tokens}
    return {f"{COMPILED} ({n})": n for n in budgets}


def run_generate_many(model, prompts, wanted, args, store: StudyStore, compile: bool = False,
                      max_batch_tokens: int | None = None):
    """`stream_many` on a fresh cache (on ``store``'s prefix store, if any); a packed model
    (`hf_paged.pack_linear_weights`) runs packed; ``compile``: through the model's compiled forward
    (`hf_paged.compile_many_steps`); ``max_batch_tokens``: the steps' budget (default ``args.max_batch_tokens``)."""
    cache = hf_paged.RaggedCache(model.config, page_size=16, kv_format=args.kv_format, prefix_store=store.store)
    outputs, first_times = [[] for _ in prompts], [None] * len(prompts)
    start = time.perf_counter()
    for index, token in hf_paged.stream_many(model, prompts, max_new_tokens=wanted, eos_token_id=[], cache=cache,
                                             max_batch_tokens=max_batch_tokens or args.max_batch_tokens,
                                             progress=False,
                                             compile=compile):
        first_times[index] = first_times[index] or time.perf_counter() - start
        outputs[index].append(token)
    elapsed = time.perf_counter() - start
    counters = store.add(cache)
    if counters:
        print("generate_many prefix store:", counters)
    return outputs, first_times, elapsed, cache.prefix_hits


def run_vllm(peer: VllmPeer):
    """One pass in vLLM's runner; its CPU-seconds are the runner process's own (its prefix reuse is not counted)."""
    answer = peer.run_pass()
    return answer["outputs"], answer["ttft"], answer["wall_s"], None, answer["cpu_s"]


def measure(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    models = {}
    for attn in ("sdpa", "hf_paged"):
        models[attn], tokenizer = assets.load_model_and_tokenizer(args.model, attn_implementation=attn)
        models[attn].generation_config.eos_token_id = None  # every request generates all it wants
    models["packed"], _ = assets.load_model_and_tokenizer(args.model, attn_implementation="hf_paged")
    models["packed"].generation_config.eos_token_id = None
    hf_paged.pack_linear_weights(models["packed"])  # once, as a user serving many calls would
    prompts, wanted = workload(tokenizer, args)
    store = StudyStore(getattr(args, "prefix_store", None))
    systems = tuple(getattr(args, "systems", SYSTEMS))
    compile_s, compiled = None, compiled_systems(args) if getattr(args, "compile", False) else {}
    if compiled:
        systems += tuple(compiled)
        models["compiled"], _ = assets.load_model_and_tokenizer(args.model, attn_implementation="hf_paged")
        models["compiled"].generation_config.eos_token_id = None
        hf_paged.compile_many_steps(models["compiled"])
        began = time.perf_counter()  # an untimed pass compiles the forward's graphs (and checks them once)
        run_generate_many(models["compiled"], prompts, wanted, args, StudyStore(None), compile=True)
        compile_s = time.perf_counter() - began
    runners = {
        "dynamic": lambda: run_generate(models["sdpa"], prompts, wanted, args, paged=False),
        "paged": lambda: run_generate(models["hf_paged"], prompts, wanted, args, paged=True),
        "transformers CB": lambda: run_transformers_cb(models["sdpa"], prompts, wanted, args),
        "generate_many": lambda: run_generate_many(models["hf_paged"], prompts, wanted, args, store),
        "generate_many packed": lambda: run_generate_many(models["packed"], prompts, wanted, args, store),
    }
    for name, budget in compiled.items():
        runners[name] = lambda budget=budget: run_generate_many(models["compiled"], prompts, wanted, args, store,
                                                                compile=True, max_batch_tokens=budget)
    peer, vllm_status = VllmPeer.start(args.vllm, assets.resolve_model_path(args.model), prompts, wanted,
                                       torch.get_num_threads())
    systems += ("vLLM CPU",) if peer else ()
    if peer:
        runners["vLLM CPU"] = lambda: run_vllm(peer)
    meter = MemoryMeter(torch.device("cpu"))
    runs = {name: [] for name in systems}
    bar = tqdm(total=args.repeats * len(systems), desc="many prompts", disable=args.no_progress)
    try:
        for repeat in range(args.repeats):
            order = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
            for name in order:
                meter.start()
                cpu = time.process_time()
                outputs, first_times, elapsed, hits, *child_cpu = runners[name]()
                cpu = child_cpu[0] if child_cpu else time.process_time() - cpu
                peak = meter.stop() if not child_cpu else float("nan")  # another process's memory is not metered
                runs[name].append(dict(outputs=outputs, ttft=statistics.mean(first_times), seconds=elapsed,
                                       cpu_s=cpu, peak_bytes=peak, prefix_hits=hits))
                bar.update()
    finally:
        bar.close()
        if peer:
            peer.close()
        store_totals = store.close("generate_many")
    reference = runs[systems[0]][0]["outputs"]
    total = sum(wanted)
    rows = []
    for name in systems:
        tps = [total / r["seconds"] for r in runs[name]]
        rows.append(dict(
            system=name, tokens_per_s=statistics.median(tps),
            spread=(max(tps) - min(tps)) / statistics.median(tps),
            cpu_s=statistics.median(r["cpu_s"] for r in runs[name]),
            ttft_s=statistics.median(r["ttft"] for r in runs[name]),
            peak_mib=statistics.median(r["peak_bytes"] for r in runs[name]) / 2**20,
            prefix_hits=runs[name][-1]["prefix_hits"],
            equal_prompts=min(sum(a == b for a, b in zip(r["outputs"], reference)) for r in runs[name])))
    for row in rows:
        row["vs_dynamic"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]  # (vs the first system run)
    return dict(settings=vars(args), prompt_lengths=[len(p) for p in prompts], wanted=wanted,
                threads=torch.get_num_threads(), load_average=load_average(), rows=rows, vllm=vllm_status,
                prefix_store=store_totals, compile_s=compile_s)


def markdown(result: dict) -> str:
    s, first = result["settings"], result["rows"][0]["system"]
    lines = [f"{s['num_prompts']} prompts of {s['min_len']}-{s['max_len']} tokens"
             + (f" after a shared {s['system_prompt']}-token system prompt" if s["system_prompt"] else "")
             + f", {s['short_new']} or {s['long_new']} new tokens each, greedy; "
             + (f"{s['kv_format']} pages; " if s.get("kv_format", "float") != "float" else "")
             + f"{result['threads']} thread(s), "
             f"load average {result['load_average']}, median of {s['repeats']}"
             + (f"; the compiled forward's untimed first pass took {result['compile_s']:.0f} s"
                if result.get("compile_s") else "")
             + (". Smoke test (--quick): checks that everything runs; its numbers are not results"
                if s["quick"] else ""),
             "",
             f"| system | tokens/s | vs {first} | spread | CPU s / pass | time to first token | peak RSS growth | "
             f"prefix pages reused | tokens equal to {first} |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['vs_dynamic']:.2f}x" + (" (noisy)" if r["spread"] > 0.2 else "")  # the spread column says how
        lines.append(f"| {r['system']} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['spread']:.0%} | {r['cpu_s']:.2f} | {r['ttft_s']:.2f} s | {_mib(r['peak_mib'])} | "
                     f"{'n/a' if r['prefix_hits'] is None else r['prefix_hits']} | "
                     f"{r['equal_prompts']}/{s['num_prompts']} |")
    if result.get("vllm", "ok") != "ok":
        lines.append(f"| vLLM CPU | {result['vllm'].splitlines()[0]} | | | | | | | |")
    return "\n".join(lines) + "\n"


def _mib(value: float) -> str:
    return "not metered (own process)" if value != value else f"{value:+.0f} MiB"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    names = [r["system"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("vs_dynamic", "ttft_s", "peak_mib"),
                              (f"tokens/s vs {names[0]} (higher is better)",
                               "mean time to first token, s (lower is better)",
                               "peak RSS growth, MiB (lower is better)")):
        values = [r[key] for r in rows]
        bars = ax.barh(names, values, color=["#888888", "#4c72b0", "#dd8452", "#55a868", "#8172b3", "#c44e52"])
        ax.bar_label(bars, fmt="%.2f" if key != "peak_mib" else "%.0f")
        ax.set_title(title, fontsize=9)
        ax.invert_yaxis()
    fig.suptitle(markdown(result).splitlines()[0], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> dict:
    """Measure the systems on the workload of ``args`` (scripts/many_prompts.py's arguments) and write the outputs."""
    result = measure(args)
    text = markdown(result)
    write_report(Path(args.out), "many_prompts", text, result, lambda path: plot(result, path), indent=1, strict=False,
                 newline=False)
    print(text)
    return result

