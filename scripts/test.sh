#!/usr/bin/env bash
# The test suite (Triton kernels run through the interpreter on a machine without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec python -m pytest -q -p no:cacheprovider "$@"
