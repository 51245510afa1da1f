#!/usr/bin/env bash
# Make ./.venv-kvpress: NVIDIA kvpress 0.5.5 beside hf_paged, for scripts/evaluation.py --kvpress.
# kvpress 0.5.5 needs transformers < 5.3, hf_paged needs >= 5.17: they cannot share one environment.
# The runner (scripts/kvpress_runner.py) does not import the hf_paged package: it loads two of its files by path
# (hf_paged/evaluation/nll.py and run_info.py, which need only torch) and reads the model folder and token ids that
# scripts/evaluation.py hands it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${KVPRESS_VENV:-.venv-kvpress}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
# torch first, pinned: kvpress would otherwise pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q "kvpress==0.5.5" "transformers<5.3" safetensors tqdm
python -c "import kvpress, transformers; print('kvpress', kvpress.__version__ if hasattr(kvpress, '__version__') else '0.5.5', 'transformers', transformers.__version__)"
