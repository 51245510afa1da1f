#!/usr/bin/env bash
# The main job: install into .venv, then compare PagedCache with DynamicCache on the embedded
# SmolLM2 model and Britannica text (speed and memory, then perplexity under page budgets).
# Results (markdown, JSON, PNG) go to results/benchmark and results/perplexity.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python scripts/benchmark.py --out results/benchmark "$@"
python scripts/perplexity.py --mode streaming --out results/perplexity
