#!/usr/bin/env bash
# The test suite, one line per test with a running percentage (Triton kernels run through the
# interpreter on a machine without a GPU).
#   bash scripts/test.sh          # fast tier: everything but the tests marked `slow` (the real SmolLM2)
#   bash scripts/test.sh --all    # everything, as CI (.ci/run) does
# Other arguments go to pytest, e.g. bash scripts/test.sh tests/test_cache_api.py -k warns
# torch's threads: $OMP_NUM_THREADS if set, else the idle cores (cores minus the load average, at least 1), as
# scripts/compare.sh chooses them: torch's default of a thread per core crawls on a busy machine.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ -z "${OMP_NUM_THREADS:-}" ]; then
  OMP_NUM_THREADS=$(python -c "import os; print(max(1, os.cpu_count() - round(os.getloadavg()[0])))")
  export OMP_NUM_THREADS
fi
echo "test.sh: torch threads $OMP_NUM_THREADS ($(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg))"
TIER=(-m "not slow")
if [ "${1:-}" = "--all" ]; then TIER=(); shift; fi
exec python -m pytest -v -p no:cacheprovider --durations=5 "${TIER[@]}" "$@"
