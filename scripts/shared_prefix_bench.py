"""One layer's packed attention (`hf_paged.attention.packed_attention`) on steps whose sequences share a cached prefix,
with the cascade over the shared prefix (`hf_paged.shared_prefix`) and without (the per-row paths), and for prefill
steps with the C prefill kernel (`hf_paged.prefill_kernel`, which the other two paths leave out), alternated, the
median CPU time of ``--repeats`` (docs/many_prompts.md, "Cascade attention over a shared prefix"). 1 thread.

Steps, on SmolLM2's attention shapes (9 query heads, 3 KV heads, head dim 64), pages of 16 tokens, random keys and
values: ``prefill``: one sequence decodes while the chunks ``--own`` (default: the lengths of
scripts/many_prompts.py's 15 other prompts) follow a shared prefix (the system-prompt workload's second step);
``decode``: ``--rows`` sequences decode after that prefix, their own tokens and ``--generated`` decoded ones. Every
(step, prefix, rows) of the sweep is measured; the outputs of the paths are compared (max abs difference).
Writes ``shared_prefix.json`` and ``shared_prefix.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hf_paged
from hf_paged import assets, shared_prefix
from hf_paged import attention
from hf_paged.attention import packed_attention
from hf_paged.evaluation import run_info
from hf_paged.evaluation.formats import int_list

OWN = "241,107,47,166,62,77,196,226,137,151,92,32,122,256,211"
THRESHOLDS = ("PREFILL_MIN_TOKENS", "DECODE_MIN_TOKENS", "DECODE_MIN_ROW_TOKENS")
PREFILL_KERNEL_APPLIES = attention.prefill_kernel_applies


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", type=int_list, default=[64, 128, 256, 512], help="shared prefix lengths (tokens)")
    p.add_argument("--rows", type=int_list, default=[2, 4, 8, 12, 16], help="decode rows per step")
    p.add_argument("--chunks", type=int_list, default=[2, 15], help="prefill chunks per step (the first of --own)")
    p.add_argument("--own", type=int_list, default=[int(n) for n in OWN.split(",")], help="own tokens per sequence")
    p.add_argument("--generated", type=int, default=20, help="decode steps before the measured one")
    p.add_argument("--repeats", type=int, default=100)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


class Step:
    """A RaggedCache of one layer's pages holding a shared prefix and the sequences after it, and the planned step."""

    def __init__(self, config, prefix: int, own: list[int], decode_rows: int, generated: int):
        self.heads = config.num_attention_heads, config.num_key_value_heads
        self.dim = config.hidden_size // config.num_attention_heads
        self.cache = hf_paged.RaggedCache(config, page_size=16)
        self.cache.add_sequence(0)
        self._step([(0, prefix + 181)])
        for i in range(1, len(own) + 1):
            self.cache.add_sequence(i, self.cache.sequences[0].pages[:prefix // 16], prefix)
        if decode_rows:
            self._step([(i, n) for i, n in enumerate(own, 1)])
            for _ in range(generated):
                self._step([(i, 1) for i in range(decode_rows)])
            self.query, self.view = self._step([(i, 1) for i in range(decode_rows)], final=False)
        else:
            self.query, self.view = self._step([(0, 1)] + [(i, n) for i, n in enumerate(own, 1)], final=False)

    def _step(self, plan, final: bool = True):
        self.cache.begin_step(plan)
        T = sum(n for _, n in plan)
        Hq, Hkv = self.heads
        q, k, v = (torch.randn(1, h, T, self.dim) for h in (Hq, Hkv, Hkv))
        view = self.cache.layers[0]._write(k, v)
        if final:
            self.cache.finish_step()
        return q, view

    def attend(self, path: str) -> tuple[float, torch.Tensor]:
        """(CPU seconds, output) of the step's attention by ``path``: "per_row", "cascade" or "kernel"."""
        for name in THRESHOLDS:
            setattr(shared_prefix, name, 16 if path == "cascade" else 10**9)
        attention.prefill_kernel_applies = PREFILL_KERNEL_APPLIES if path == "kernel" else lambda *args: False
        began = time.process_time()
        out = packed_attention(self.query, self.view, self.dim ** -0.5, None, None, None)
        return time.process_time() - began, out


def measure(step: Step, repeats: int, paths: tuple[str, ...]) -> dict:
    defaults = {name: getattr(shared_prefix, name) for name in THRESHOLDS}
    try:
        outs = [step.attend(path)[1] for path in paths]
        diff = max((out - outs[0]).abs().max().item() for out in outs[1:])
        times = {path: [] for path in paths}
        for r in range(repeats):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                times[path].append(step.attend(path)[0])
    finally:
        for name, value in defaults.items():
            setattr(shared_prefix, name, value)
        attention.prefill_kernel_applies = PREFILL_KERNEL_APPLIES
    ms = {path: statistics.median(times[path]) * 1e3 for path in paths}
    return {"per_row_ms": ms["per_row"], "cascade_ms": ms["cascade"], "ratio": ms["cascade"] / ms["per_row"],
            "kernel_ms": ms.get("kernel"), "kernel_ratio": ms["kernel"] / ms["per_row"] if "kernel" in ms else None,
            "max_abs_diff": diff}


def main(args) -> list[dict]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    load_before = run_info.load_average()
    config = assets.load_model_and_tokenizer(args.model, attn_implementation="hf_paged")[0].config
    rows = []
    for prefix in args.prefixes:
        for chunks in args.chunks:
            step = Step(config, prefix, args.own[:chunks], 0, 0)
            rows.append({"step": "prefill", "prefix": prefix, "rows": chunks,
                         **measure(step, args.repeats, ("per_row", "cascade", "kernel"))})
        for decode_rows in args.rows:
            step = Step(config, prefix, args.own[:max(decode_rows - 1, 1)], decode_rows, args.generated)
            rows.append({"step": "decode", "prefix": prefix, "rows": decode_rows,
                         **measure(step, args.repeats, ("per_row", "cascade"))})
        print(*(f"{r['step']} prefix {r['prefix']} rows {r['rows']}: cascade {r['ratio']:.3f}" + ("" if r['kernel_ratio'] is None else f", prefill kernel {r['kernel_ratio']:.3f}") for r in rows[-2:]), sep="\n")
    args.out.mkdir(parents=True, exist_ok=True)
    settings = vars(args) | {"out": str(args.out), "load_average": [load_before, run_info.load_average()],
                             "source": run_info.source_fingerprint(hf_paged), **run_info.versions(("torch",))}
    (args.out / "shared_prefix.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    lines = [f"load average {load_before} -> {run_info.load_average()}", "",
             "| step | shared prefix | rows | per-row paths (ms) | cascade (ms) | cascade / per-row | prefill kernel (ms) "
             "| kernel / per-row | max abs diff |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['prefix']} | {r['rows']} | {r['per_row_ms']:.3f} | {r['cascade_ms']:.3f} | "
              f"{r['ratio']:.3f} | " + ("— | — | " if r["kernel_ms"] is None else
                                        f"{r['kernel_ms']:.3f} | {r['kernel_ratio']:.3f} | ")
              + f"{r['max_abs_diff']:.1e} |" for r in rows]
    (args.out / "shared_prefix.md").write_text("\n".join(lines) + "\n")
    return rows


if __name__ == "__main__":
    main(parse_args())
