#!/usr/bin/env bash
# The test suite, one line per test with a running percentage (Triton kernels run through the
# interpreter on a machine without a GPU).
#   bash scripts/test.sh          # fast tier: everything but the tests marked `slow` (the real SmolLM2)
#   bash scripts/test.sh --all    # everything, as CI (.ci/run) does
# Other arguments go to pytest, e.g. bash scripts/test.sh tests/test_cache_api.py -k warns
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TIER=(-m "not slow")
if [ "${1:-}" = "--all" ]; then TIER=(); shift; fi
exec python -m pytest -v -p no:cacheprovider --durations=5 "${TIER[@]}" "$@"
