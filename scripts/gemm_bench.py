"""The linear layers' matrix multiplies of one forward, by method and row count (docs/many_prompts.md, "GEMMs against
vLLM's"): every layer's four GEMMs (merged q/k/v, o, merged gate/up, down) with distinct weights, streamed as a step
streams them, and the output projection alone; 1 thread, the methods alternated, the median of ``--repeats``.

Methods: ``flinear`` (``F.linear``), ``mm_t`` (``torch.mm`` on the transposed weight), ``packedN`` (hf_paged's packed
linear: oneDNN's inner product on ``torch.ops.mkldnn._reorder_linear_weight(w, N)``), ``mkl`` (MKL's packed GEMM,
packed for exactly the row count), ``vllm`` (vLLM CPU's ``onednn_mm``; only where vllm imports: run this script with
``.venv-vllm/bin/python``, made by ``scripts/make_vllm_env.sh``). The shapes default to the embedded SmolLM2-135M's.
Writes ``gemm.json`` and ``gemm.md`` (milliseconds, GB/s of weights, GFLOP/s) into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,12,16,64,256", help="row counts M, comma-separated")
    parser.add_argument("--methods", default="flinear,mm_t,packed1,packed8,packed16,packed64,packed256,mkl,vllm")
    parser.add_argument("--repeats", type=int, default=5, help="alternated rounds; the median is reported")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--kv-dim", type=int, default=192, help="keys' (and values') projection width")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def vllm_ops():
    try:
        from vllm import _custom_ops
    except ImportError:
        return None
    return _custom_ops


def make(method: str, weight: torch.Tensor, rows: int, ops):
    """``x -> x @ weight.T`` by ``method``, its weight prepared once."""
    if method == "flinear":
        return lambda x: F.linear(x, weight)
    if method == "mm_t":
        transposed = weight.t().contiguous()
        return lambda x: torch.mm(x, transposed)
    if method.startswith("packed"):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, int(method.removeprefix("packed")))
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if method == "mkl":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
    if method == "vllm":
        handle = ops.create_onednn_mm(weight.t(), 32)
        return lambda x: ops.onednn_mm(handle, x, None)
    raise SystemExit(f"unknown method {method!r}: choose among flinear, mm_t, packedN, mkl, vllm")


def time_methods(calls: dict, inputs: dict, repeats: int, inner: int) -> dict[str, float]:
    """Median seconds of one pass over each method's (function, input width) calls, the methods alternated."""
    def run(method):
        for fn, width in calls[method]:
            fn(inputs[width])
    for method in calls:
        run(method)  # warm: primitives made, weights touched
    times = {method: [] for method in calls}
    for _ in range(repeats):
        for method in calls:
            start = time.thread_time()
            for _ in range(inner):
                run(method)
            times[method].append((time.thread_time() - start) / inner)
    return {method: statistics.median(t) for method, t in times.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    ops = vllm_ops()
    methods = [m for m in args.methods.split(",") if m != "vllm" or ops is not None]
    h, kv, inter = args.hidden, args.kv_dim, args.intermediate
    layer_shapes = [(h, h + 2 * kv), (h, h), (h, 2 * inter), (inter, h)]  # (in, out) of each GEMM of a layer
    stack = [[torch.randn(n, k) * 0.02 for k, n in layer_shapes] for _ in range(args.layers)]
    head = torch.randn(args.vocab, h) * 0.02
    targets = {"layers": ([(w, k) for layer in stack for w, (k, _) in zip(layer, layer_shapes)], 3),
               "output projection": ([(head, h)], 10)}
    results = {"methods": methods, "vllm": ops is not None, "rows": {}, "load": os.getloadavg()}
    for rows in tqdm([int(m) for m in args.rows.split(",")], desc="row counts"):
        inputs = {width: torch.randn(rows, width) for width in {h, inter}}
        for target, (weights, inner) in targets.items():
            calls = {m: [(make(m, w, rows, ops), width) for w, width in weights] for m in methods}
            reference = F.linear(inputs[weights[0][1]], weights[0][0])
            for method, fns in calls.items():  # every method computes the same product
                torch.testing.assert_close(fns[0][0](inputs[weights[0][1]]), reference, atol=1e-4, rtol=1e-3)
            seconds = time_methods(calls, inputs, args.repeats, inner)
            weight_bytes = sum(4 * w.numel() for w, _ in weights)
            flops = sum(2 * rows * w.numel() for w, _ in weights)
            results["rows"].setdefault(str(rows), {})[target] = {m: {
                "ms": s * 1e3, "GB/s": weight_bytes / s / 1e9, "GFLOP/s": flops / s / 1e9} for m, s in seconds.items()}
    results["load_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemm.json").write_text(json.dumps(results, indent=1))
    lines = [f"GEMMs, ms a pass (1 thread, median of {args.repeats}, load {results['load'][0]:.1f} at the start, "
             f"{results['load_end'][0]:.1f} at the end)", ""]
    for target in targets:
        lines += [f"{target}:", "", "| rows | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
        lines += [f"| {rows} | " + " | ".join(f"{by[target][m]['ms']:.2f}" for m in methods) + " |"
                  for rows, by in results["rows"].items()] + [""]
    (args.out / "gemm.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
