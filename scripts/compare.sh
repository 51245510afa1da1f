#!/usr/bin/env bash
# The main job: install into .venv, then compare PagedCache with DynamicCache on the embedded SmolLM2-135M-Instruct
# and the Britannica text: speed and memory (scripts/benchmark.py, about 8 minutes on 2 idle cores), perplexity
# under page budgets (scripts/perplexity.py, 2048 tokens, about 3.5 minutes), then many prompts of different lengths
# (scripts/many_prompts.py: generate_many against generate and transformers' continuous batching, about 6.5
# minutes), then quantized pages through the real caches (scripts/quantized.py --parts cache,agreement,decode at 2048
# tokens, greedy agreement of generate_many's page formats and cold pages over the many-prompts workload, decode at
# 1k and 4k, with transformers' QuantizedCache where optimum-quanto is installed; about 19 minutes; the
# stored results at 8k and 16k tokens have their commands in docs/quantized.md). Each run writes a new folder runs/<UTC time>[-quick]/ (git-ignored); nothing tracked changes.
#
#   bash scripts/compare.sh [--quick] [--threads N] [--out DIR] [--no-install] [--prefix-store]
#     --quick        smoke test of every part (about 90 s on 2 idle cores); its numbers are not results
#     --threads N    torch threads for every part (default: the idle cores, i.e. cores minus the load average,
#                    at least 1; too many threads on a busy machine make every ratio noise)
#     --out DIR      write DIR/benchmark, DIR/perplexity, DIR/many_prompts and DIR/quantized instead of runs/<UTC time>/. The
#                    stored results in results/ each have their own command, named in docs/ (benchmark.md,
#                    perplexity.md, many_prompts.md, ...)
#     --no-install   skip scripts/install.sh and use the `python` on PATH as it is
#     --prefix-store also time the first token of a 2k-token prompt in fresh processes, computed or loaded from a
#                    folder or Redis prefix store, and generate_many in 2 torchrun processes sharing one
#                    (scripts/prefix_store.py, about 15 minutes; --quick: 4 minutes)
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=() THREADS="" OUT="" INSTALL=1 STORE=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=(--quick) ;;
    --threads) THREADS=${2:?--threads needs a number}; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift ;;
    --no-install) INSTALL="" ;;
    --prefix-store) STORE=1 ;;
    *) echo "compare.sh: unknown argument '$1' (expected --quick, --threads N, --out DIR, --no-install," \
            "--prefix-store)" >&2; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
if [ -n "$INSTALL" ]; then
  bash scripts/install.sh
  . .venv/bin/activate
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "$THREADS" ]; then
  THREADS=$(python -c "import os; print(max(1, os.cpu_count() - round(os.getloadavg()[0])))")
fi
OUT=${OUT:-runs/$(date -u +%Y%m%d-%H%M%S)${QUICK:+-quick}}
echo "compare.sh: torch threads $THREADS ($(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)); writing $OUT/"
[ ${#QUICK[@]} -eq 0 ] || echo "compare.sh: --quick is a smoke test: it checks that everything runs; its numbers are not results"
python scripts/benchmark.py "${QUICK[@]}" --threads "$THREADS" --out "$OUT/benchmark"
python scripts/perplexity.py --mode streaming "${QUICK[@]}" --threads "$THREADS" --out "$OUT/perplexity"
python scripts/many_prompts.py "${QUICK[@]}" --threads "$THREADS" --out "$OUT/many_prompts"
if [ ${#QUICK[@]} -eq 0 ]; then
  QUANTIZED=(--cache-tokens 2048 --decode-contexts 1024,4096 --decode-tokens 8 --repeats 3)
else
  QUANTIZED=(--quick --repeats 1)  # (one round: the agreement part runs each of its 5 entries once)
fi
python scripts/quantized.py --parts cache,agreement,decode "${QUANTIZED[@]}" --threads "$THREADS" --out "$OUT/quantized"
[ -z "$STORE" ] || python scripts/prefix_store.py "${QUICK[@]}" --threads "$THREADS" --out "$OUT/prefix_store"
echo "compare.sh: done in $(( $(date +%s) - START )) s; results in $OUT/ (benchmark/, perplexity/, many_prompts/, quantized/:" \
     ".md, .json, .png)"
