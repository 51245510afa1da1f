"""Paired bootstrap intervals between the continuation rows of `scripts/evaluation.py` runs (their jobs.json).

Each row (method, regime, budget) is compared with a reference method at the same regime and budget, and with the
full cache, over the same windows (and their 64-token blocks when the jobs recorded them)::

    python scripts/paired_rows.py runs/mp/compress/jobs.json --reference "hf_paged score"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_paged.evaluation.intervals import paired_ratio_interval  # noqa: E402


def blocks(job: dict) -> list[tuple[tuple, float, int]]:
    """((window, block), NLL sum, tokens) of a job: its 64-token blocks, else the whole window."""
    if job.get("block_nll"):
        sizes = [min(64, job["tokens"] - 64 * i) for i in range(len(job["block_nll"]))]
        return [((job["window"], i), nll, n) for i, (nll, n) in enumerate(zip(job["block_nll"], sizes))]
    return [((job["window"], 0), job["nll_sum"], job["tokens"])]


def rows(jobs: list[dict]) -> dict[tuple, dict]:
    """(method, regime, budget) -> {(window, block): (nll, tokens)}."""
    out: dict[tuple, dict] = {}
    for job in jobs:
        if job.get("task") == "continuation" and "nll_sum" in job:
            key = (job["method"], job["regime"] if job["regime"] != "full" else None, job["budget"])
            out.setdefault(key, {}).update({k: (nll, n) for k, nll, n in blocks(job)})
    return out


def compare(row: dict, reference: dict) -> str:
    keys = sorted(set(row) & set(reference))
    if not keys:
        return "—"
    ratio, low, high = paired_ratio_interval([row[k][0] for k in keys], [reference[k][0] for k in keys],
                                             [row[k][1] for k in keys])
    return f"{ratio:+.2%} [{low:+.2%}, {high:+.2%}] ({len(keys)} blocks)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("jobs", nargs="+", help="jobs.json files of evaluation.py runs (same windows and text)")
    p.add_argument("--reference", default="hf_paged score", help="the method each row is paired with")
    args = p.parse_args(argv)
    table = {}
    for path in args.jobs:
        table.update(rows(json.loads(Path(path).read_text())))
    full = table.get(("full", None, None), {})
    print(f"| method | regime | B | vs full [95%] | vs {args.reference} [95%] |\n|---|---|---:|---:|---:|")
    for (method, regime, budget), row in sorted(table.items(), key=lambda kv: (str(kv[0][1]), kv[0][2] or 0,
                                                                               kv[0][0])):
        if regime is None:
            continue
        reference = table.get((args.reference, regime, budget), {})
        versus = "—" if method == args.reference else compare(row, reference)
        print(f"| {method} | {regime} | {budget} | {compare(row, full)} | {versus} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
